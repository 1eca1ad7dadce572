"""``HeadSplit`` (model/head_split.py): a prompt chunk's attention with the last kv heads' share computed on a
peer equals the unsplit attention bit for bit (each head by the same kernel on the same inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.head_split import HeadSplit
from strata_core.model.ops import masked_attention, sdpa_attention


def _case(T: int, S: int, nh: int, nkv: int, D: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(T * 7 + S)
    q = torch.randn(T, nh, D, generator=gen).to(dtype).to(device)
    keys = torch.randn(S, nkv, D, generator=gen).to(dtype).to(device)
    values = torch.randn(S, nkv, D, generator=gen).to(dtype).to(device)
    positions = torch.arange(S - T, S).to(device)  # the chunk is the last T of S positions
    return q, keys, values, positions


@pytest.mark.parametrize("nh, nkv, peer_kv", [(4, 2, 1), (8, 4, 2), (8, 4, 3), (6, 6, 3)])
def test_on_the_cpu_the_split_heads_equal_the_whole(nh, nkv, peer_kv):
    q, keys, values, positions = _case(9, 20, nh, nkv, 16, "cpu", torch.float32)
    split = HeadSplit(torch.device("cpu"), torch.device("cpu"), peer_kv)
    got = split(q, keys, values, positions, masked_attention)
    assert split.splits(9, 20, nh, nkv) and not split.splits(9, 9, nh, nkv)
    assert torch.equal(got, masked_attention(q, keys, values, positions))


CUDA_PAIRS = ([("cuda:0", "cuda:0")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() > 1 else [])
              if torch.cuda.is_available() else [])


@pytest.mark.skipif(not CUDA_PAIRS, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_PAIRS, ids=",".join)
@pytest.mark.parametrize("T, S", [(512, 512), (512, 1500), (1100, 1100), (1100, 3001), (2048, 8192), (8192, 32768)])
def test_on_cuda_sdpa_split_heads_equal_the_whole(devices, T, S):
    """Chunks split and (short ones) not: FlashAttention's split-KV never makes the bits depend on it."""
    q, keys, values, positions = _case(T, S, 32, 4, 128, devices[0], torch.bfloat16)
    calls = []

    def attend(q, keys, values, positions):
        calls.append(q.shape[1])
        return sdpa_attention(q, keys, values, positions)

    split = HeadSplit(torch.device(devices[0]), torch.device(devices[1]), 2)
    got = split(q, keys, values, positions, attend)
    assert calls == ([16, 16] if split.splits(T, S, 32, 4) else [32])
    assert split.splits(T, S, 32, 4) or T < 8192 or S == T  # 16 heads x 128 blocks: split on up to 1024 SMs
    assert got.device == q.device and torch.equal(got, attend(q, keys, values, positions))


def test_a_model_with_its_own_attention_keeps_every_head_home(tiny_model_factory):
    """peer_tier asks for the split by default; gpt-oss (sinks, sliding windows) runs its own attention, so
    no split is installed for it, while a qwen3moe model's every prompt layer gets one."""
    oss = Path(__file__).parent / "data" / "gpt-oss_llamacpp" / "model-mxfp4.gguf"
    engine = Engine.load(oss, strategy="peer_tier", devices=["cpu", "cpu"], max_context=64, arena="pinned")
    assert engine.model.head_splits == {} and not engine.model.splits_heads
    qwen = Engine.load(tiny_model_factory(), strategy="peer_tier", devices=["cpu", "cpu"], max_context=64,
                       arena="pinned")
    assert len(qwen.model.head_splits) == qwen.spec.n_layers
