"""The kernel ops' CPU side: references, fakes, opcheck, and the device attention's math (run on the CPU).

The CUDA kernels are checked against these references in tests/test_kernels_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.gather import pair_ffn
from strata_core.model.ops import sdpa_attention
from strata_core.ops.gather import gather_experts
from strata_core.ops.matmul import matmul
from strata_core.ops.moe import moe_pair_rows
from strata_core.ops.qdecode import KERNEL_TYPES, block_geometry
from strata_core.quant import SUPPORTED_TYPES, dequantize, random_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


def experts(qtypes, hidden: int, ffn: int, n: int, seed: int = 0):
    """``n`` random packed experts ``[n, total]`` of (gate, up, down) types and their ExpertFormat."""
    rng = np.random.default_rng(seed)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    parts = []
    for qtype, (rows, cols) in zip(qtypes, shapes):
        bs, _, _ = block_geometry(qtype)
        parts.append(random_blocks(qtype, n * rows * cols // bs, rng, scale=0.1).reshape(n, -1))
    fmt = ExpertFormat(tuple(qtypes), shapes, tuple(p.shape[1] for p in parts))
    return torch.from_numpy(np.concatenate(parts, axis=1)), fmt


def op_args(x, slots, arena, slot, expert, k, fmt):
    return (x, slots, arena, slot, expert, k, [int(q) for q in fmt.qtypes],
            [n for shape in fmt.shapes for n in shape], list(fmt.nbytes))


def test_kernel_types_cover_the_popular_moe_formats():
    want = {T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.MXFP4}
    assert want <= KERNEL_TYPES <= SUPPORTED_TYPES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_dtype_is_the_float32_reference_cast(dtype):
    raw = torch.from_numpy(random_blocks(T.Q4_K, 6, np.random.default_rng(1))).reshape(3, -1)
    got = dequantize(raw, T.Q4_K, (3, 512), dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize(raw, T.Q4_K, (3, 512)).to(dtype))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_opcheck_dequantize_with_dtype(dtype):
    raw = torch.from_numpy(random_blocks(T.Q6_K, 4, np.random.default_rng(2))).reshape(2, -1)
    torch.library.opcheck(torch.ops.strata.dequantize.default, (raw, int(T.Q6_K), [2, 512], dtype))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 3), k=st.integers(1, 4), slots=st.integers(0, 4))
def test_moe_pair_rows_reference_is_the_gather_then_pair_ffn(seed, tokens, k, slots):
    """The op's CPU kernel equals the decode gather's two steps bit for bit, any residency."""
    arena, fmt = experts((T.Q4_0, T.Q4_0, T.Q8_0), 64, 32, 6, seed)
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(slots, fmt.total + 8, dtype=torch.uint8)
    held = torch.randperm(6, generator=gen)[:slots]
    cache[:, :fmt.total] = arena[held]
    expert = torch.randint(0, 6, (tokens * k,), generator=gen)
    where = (expert[:, None] == held[None, :]).int().argmax(1) if slots else torch.zeros_like(expert)
    slot = torch.where(torch.isin(expert, held), where, -1)
    x = torch.randn(tokens, 64, generator=gen)
    got = moe_pair_rows(*op_args(x, cache, arena, slot, expert, k, fmt))
    packed = gather_experts(cache, arena, slot, expert, fmt.total)
    assert torch.equal(got, pair_ffn(x.repeat_interleave(k, 0), packed, fmt))


def test_opcheck_moe_pair_rows_and_its_fake_shape():
    arena, fmt = experts((T.Q8_0, T.Q8_0, T.Q4_0), 64, 32, 4)
    slot, expert = torch.tensor([1, -1, 0, -1]), torch.tensor([2, 3, 0, 1])
    args = op_args(torch.randn(2, 64), arena[[0, 2]].clone(), arena, slot, expert, 2, fmt)
    torch.library.opcheck(torch.ops.strata.moe_pair_rows.default, args)
    torch.library.opcheck(torch.ops.strata.moe_pair_rows.default, args, {"direct_misses": True})
    assert torch.equal(moe_pair_rows(*args, direct_misses=True), moe_pair_rows(*args))  # the kernels' choice only
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = moe_pair_rows(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args),
                             direct_misses=True)
    assert fake.shape == (4, 64)


def masked_reference(q, keys, values, positions):
    """The CPU path's attention: repeat kv heads, masked scores over all S, float32 softmax."""
    T, nh, D = q.shape
    rep = nh // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(rep, dim=0)  # [nh, S, D]
    v = values.transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = matmul(q.transpose(0, 1), k.transpose(1, 2)) * D ** -0.5  # [nh, T, S]
    visible = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(q.dtype)
    return matmul(probs, v).transpose(0, 1).reshape(T, nh * D)


@pytest.mark.parametrize("T_, S, static", [(1, 9, False), (1, 9, True), (5, 5, False), (3, 11, False),
                                           (3, 11, True), (1, 1, False)])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_sdpa_attention_equals_the_masked_matmul(T_, S, static, heads):
    """The device attention's masks and head folding, checked on the CPU: queries are the last T of
    S positions (static: the cache is longer than the context, the mask hides the rest)."""
    gen = torch.Generator().manual_seed(T_ * 100 + S)
    nh, nkv = heads
    n_ctx = S - 4 if static and S > 4 else S
    positions = torch.arange(n_ctx - T_, n_ctx)
    q = torch.randn(T_, nh, 16, generator=gen)
    keys, values = torch.randn(S, nkv, 16, generator=gen), torch.randn(S, nkv, 16, generator=gen)
    got = sdpa_attention(q, keys, values, positions, static)
    torch.testing.assert_close(got, masked_reference(q, keys, values, positions), rtol=1e-5, atol=1e-5)
