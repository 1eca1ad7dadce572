"""gpt-oss on a CUDA device against the CPU: the fused decode kernels with expert biases and
swiglu_oai against their CPU reference; prompts (grouped prefill with the biases, misses streamed),
decode windows (the decode gather: the fused kernels, or ``pair_ffn_grouped`` with ``fused_expert_ffn`` off)
eager and captured as CUDA graphs. The model is ``make-synthetic --preset gpt-oss-tiny`` (MXFP4
experts, Q8_0 dense, window 8, sinks, YaRN)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata_core.engine import Engine
from strata_core.experts.ffn import ExpertFFN
from strata_core.ops.moe import ffn_args, moe_decode, moe_pair_rows
from strata_core.tools.synthetic import write_synthetic

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [(7 * i) % 500 for i in range(60)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny.gguf"
    write_synthetic(path, "gpt-oss-tiny", progress=False)
    return path


def _close(a: torch.Tensor, b: torch.Tensor, rel: float, rows: float = 1.0) -> bool:
    """At least a fraction ``rows`` of the rows of ``a`` are within ``rel`` x max|b| of ``b``'s."""
    a, b = a.float().cpu().reshape(-1, b.shape[-1]), b.float().cpu().reshape(-1, b.shape[-1])
    return ((a - b).abs().amax(-1) <= rel * b.abs().max()).float().mean().item() >= rows


def _windows(engine: Engine, prompt_lens: list[int], steps: int) -> list[torch.Tensor]:
    sessions = [engine.new_session() for _ in prompt_lens]
    for s, n in zip(sessions, prompt_lens):
        engine.prefill(s, PROMPT[:n])
    return [engine.decode_window([(s, PROMPT[n + step]) for s, n in zip(sessions, prompt_lens)]).cpu()
            for step in range(4)]


@needs_cuda
@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fused_kernels_apply_biases_and_swiglu_oai(dtype, rel):
    """MXFP4 experts of hidden 256 / FFN 256: ``moe_pair_rows`` and ``moe_decode`` on CUDA (misses in
    a pinned host arena staged) against their CPU reference, with and without the ExpertFFN."""
    from gguf import GGMLQuantizationType as Q

    from strata_core.quant import random_blocks

    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    E, H, F, T, k = 8, 256, 256, 3, 4
    parts = [random_blocks(Q.MXFP4, E * F * H // 32, rng, 0.1).reshape(E, -1) for _ in range(3)]
    layer = torch.from_numpy(np.concatenate(parts, axis=1))  # [E, total]
    held = torch.tensor([1, 4, 6])
    expert = torch.randint(0, E, (T * k,), generator=gen)
    slot = torch.where(torch.isin(expert, held), (expert[:, None] == held).int().argmax(1), -1)
    x, weights = torch.randn(T, H, generator=gen), torch.rand(T, k, generator=gen)
    ffn = ExpertFFN("swiglu_oai", *(torch.randn(E, n, generator=gen) for n in (F, F, H)))
    args = [int(Q.MXFP4)] * 3, [F, H, F, H, H, F], [p.shape[1] for p in parts]
    for f in (ExpertFFN(), ffn):
        want_rows = moe_pair_rows(x, layer[held], layer, slot, expert, k, *args, **ffn_args(f))
        want = moe_decode(x, layer[held], layer, slot, expert, weights, k, *args, **ffn_args(f))
        cuda = ffn_args(ExpertFFN(f.activation, *(None if b is None else b.cuda().to(dtype)
                                                  for b in (f.gate_bias, f.up_bias, f.down_bias))))
        dev = (x.cuda().to(dtype), layer[held].cuda(), layer.pin_memory(), slot.cuda(), expert.cuda())
        assert _close(moe_pair_rows(*dev, k, *args, **cuda), want_rows, rel)
        assert _close(moe_decode(*dev, weights.cuda().to(dtype), k, *args, **cuda), want, rel)


@needs_cuda
@pytest.mark.parametrize("arena, fused, dtype, rel, rows", [
    ("mmap", True, "float32", 2e-3, 1.0),  # decode by the loop per expert
    ("pinned", True, "float32", 2e-3, 1.0),  # the decode gather: the biased experts in the fused kernels
    ("pinned", False, "float32", 2e-3, 1.0),  # the decode gather through pair_ffn_grouped
    ("pinned", True, "bfloat16", 6e-2, 1.0),  # (on the CPU in bf16: within 0.9%; 2.4% with router noise)
])
def test_prompt_and_decode_on_cuda_match_the_cpu(model, dtype, rel, rows, arena, fused):
    cpu = Engine.load(model, max_context=128)
    gpu = Engine.load(model, devices=["cuda:0"], max_context=128, dtype=dtype, expert_cache=12, arena=arena,
                      fused_expert_ffn=fused)
    reference = cpu.logits(PROMPT)
    assert _close(gpu.logits(PROMPT), reference, rel, rows)
    gpu.settings.prefill_chunk = 7  # chunks across the window of 8
    assert _close(gpu.logits(PROMPT), reference, rel, rows)
    windows = torch.cat(_windows(gpu, [20, 45], 4))
    assert _close(windows, torch.cat(_windows(cpu, [20, 45], 4)), rel, rows)


@needs_cuda
def test_decode_windows_replayed_as_cuda_graphs_match_eager(model):
    eager = Engine.load(model, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                        cuda_graphs=False)
    graphs = Engine.load(model, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                         cuda_graphs=True)
    for a, b in zip(_windows(graphs, [30, 50], 4), _windows(eager, [30, 50], 4)):
        assert _close(a, b, 1e-4)
