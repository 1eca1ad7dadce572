"""The Triton kernels on CUDA against their CPU references (the oracle), within documented tolerances.

- ``strata::dequantize``: float32 within a relative 1e-6 of the reference (fused multiply-adds only);
  bf16 / fp16 within one rounding of the reference's float32 values; every element written.
- ``strata::moe_pair_rows``: relative (Frobenius) error under 1e-5 in float32, 2e-2 in bf16, for
  resident pairs, misses staged from a pinned arena, read zero-copy, and from a device arena.
- ``sdpa_attention``: the flash / efficient kernels against the masked matmul in float32.

Runs where CUDA and Triton exist (the GPU machine); skipped elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.model.ops import sdpa_attention
from strata_core.model.rope import scaled_inv_freq
from strata_core.ops import moe
from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES, block_geometry
from strata_core.quant import dequantize, random_blocks

from test_kernels import experts, masked_reference, op_args

pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"),
              pytest.mark.usefixtures("float_cpu_kernels")]  # CUDA's float products against the CPU's
DEV = torch.device("cuda:0")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
def test_dequantize_kernel_matches_the_reference(qtype):
    bs, ts, _ = block_geometry(qtype)
    rows, per_row = 37, 5  # 185 blocks: not a multiple of any program's block count
    raw = torch.from_numpy(random_blocks(qtype, rows * per_row, np.random.default_rng(int(qtype)))).view(rows, -1)
    shape = (rows, per_row * bs)
    want = dequantize(raw, qtype, shape)  # CPU reference, float32
    got = dequantize(raw.to(DEV), qtype, shape)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # strided rows (a gate/up/down view of packed experts), written straight in bf16 / fp16
    packed = torch.zeros(rows, raw.shape[1] + 48, dtype=torch.uint8)
    packed[:, 16:16 + raw.shape[1]] = raw
    view = packed.to(DEV)[:, 16:16 + raw.shape[1]]
    for dtype in (torch.bfloat16, torch.float16):
        got = dequantize(view, qtype, shape, dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), rtol=1e-2,
                                   atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ3_S, T.MXFP4, T.IQ2_XXS], ids=lambda t: t.name)
def test_opcheck_dequantize_on_cuda(qtype):
    """IQ2_XXS has no kernel: the CUDA op falls back to the reference."""
    bs, _, _ = block_geometry(qtype)
    raw = torch.from_numpy(random_blocks(qtype, 8, np.random.default_rng(3))).view(2, -1).to(DEV)
    torch.library.opcheck(torch.ops.strata.dequantize.default, (raw, int(qtype), [2, 4 * bs], torch.bfloat16))


def _moe_case(qtypes, hidden, ffn, dtype, where, seed=0, tokens=3, k=4):
    arena, fmt = experts(qtypes, hidden, ffn, 9, seed)
    gen = torch.Generator().manual_seed(seed)
    held = torch.tensor([1, 4, 6, 7])
    slots = torch.zeros(5, fmt.total + 64, dtype=torch.uint8)  # one spare slot, wider rows than one expert
    slots[:4, :fmt.total] = arena[held]
    expert = torch.randint(0, 9, (tokens * k,), generator=gen)
    slot = torch.full_like(expert, -1)
    for i, e in enumerate(held.tolist()):
        slot[expert == e] = i
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype)
    want = moe.moe_pair_rows(*op_args(x, slots, arena, slot, expert, k, fmt))  # CPU reference
    src = arena.to(DEV) if where == "device" else arena.pin_memory()
    return op_args(x.to(DEV), slots.to(DEV), src, slot.to(DEV), expert.to(DEV), k, fmt), want


@pytest.mark.parametrize("where", ["staged", "direct", "device"])
@pytest.mark.parametrize("qtypes", [(T.Q4_K,) * 3, (T.Q8_0,) * 3, (T.Q5_K, T.Q6_K, T.IQ4_XS),
                                    (T.Q2_K, T.Q3_K, T.MXFP4), (T.IQ3_XXS, T.IQ3_S, T.Q4_0)],
                         ids=lambda q: "-".join(t.name for t in q))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_pair_rows_kernel_matches_the_reference(qtypes, where, dtype):
    args, want = _moe_case(qtypes, 512, 256, dtype, where)
    got = moe.moe_pair_rows(*args, direct_misses=where == "direct")
    assert got.dtype == dtype and got.shape == want.shape
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_moe_pair_rows_odd_shapes_and_fallback_type():
    """Block counts that do not fill a program's step, and a type without a kernel (reference)."""
    args, want = _moe_case((T.Q8_0, T.Q4_0, T.Q8_0), 96, 160, torch.float32, "staged", tokens=1, k=3)
    assert rel(moe.moe_pair_rows(*args), want) < 1e-5
    args, want = _moe_case((T.IQ2_XXS, T.Q4_K, T.Q4_K), 256, 256, torch.float32, "staged", tokens=1, k=2)
    assert rel(moe.moe_pair_rows(*args), want) < 1e-5


def test_opcheck_moe_pair_rows_on_cuda():
    """With the arena on the device: opcheck copies its inputs, and a copy of a pinned tensor is not
    pinned (the kernel reads a host arena by its device-mapped address, which needs pinned memory)."""
    args, _ = _moe_case((T.Q4_K,) * 3, 256, 256, torch.bfloat16, "device", tokens=2, k=2)
    torch.library.opcheck(torch.ops.strata.moe_pair_rows.default, args)


def test_moe_pair_rows_replays_in_a_cuda_graph_with_new_routing():
    args, _ = _moe_case((T.Q4_K,) * 3, 256, 256, torch.float32, "staged", tokens=2, k=2)
    x, slots, arena, slot, expert = args[:5]
    moe.moe_pair_rows(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_pair_rows(*args)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        expert.copy_(torch.randint(0, 9, expert.shape, generator=gen))
        slot.copy_(torch.where(expert.cpu() == 1, 0, -1))
        x.copy_(torch.randn(x.shape, generator=gen))
        graph.replay()
        torch.testing.assert_close(out, moe.moe_pair_rows(*args), rtol=0, atol=0)


@pytest.mark.parametrize("P", [1, 8, 40, 300])
def test_pair_bookkeeping_kernel_equals_the_torch_ops(P):
    """One launch (slots, usage, telemetry) gives the integers of the CPU's torch ops, added in place."""
    from strata_core.experts.gather import count_pairs, lookup_slots

    gen = torch.Generator().manual_seed(P)
    resident = torch.where(torch.rand(128, generator=gen) < 0.4, torch.arange(128), -1).to(torch.int32)
    expert = torch.randint(0, 128, (P,), generator=gen)
    usage, counters = torch.randint(0, 99, (128,), generator=gen), torch.tensor([5, 6, 7, 8])
    on = [t.to(DEV) for t in (expert, resident, usage, counters)]
    want = lookup_slots(expert, resident, usage, counters, 12345)  # the CPU's torch ops
    got = lookup_slots(*on, 12345)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert on[2].tolist() == usage.tolist() and on[3].tolist() == counters.tolist()
    by_peer = (torch.rand(128, generator=gen) < 0.5)[expert]  # a peer serves these experts' pairs
    redirected = torch.where((want < 0) & by_peer, 0, want).to(torch.int32)  # its pairs: a zero slot here
    count_pairs(redirected, expert, resident, counters, 777)
    count_pairs(redirected.to(DEV), on[0], on[1], on[3], 777)
    assert on[3].tolist() == counters.tolist()
    live = torch.tensor([P // 2])  # a padded window: only the first half of the pairs count
    want = lookup_slots(expert, resident, usage, counters, 12345, live)
    assert lookup_slots(*on, 12345, live.to(DEV)).tolist() == want.tolist()
    assert on[2].tolist() == usage.tolist() and on[3].tolist() == counters.tolist()


@pytest.mark.parametrize("T_, S, static", [(1, 300, False), (1, 300, True), (64, 64, False), (40, 300, False)])
def test_sdpa_attention_on_cuda_matches_the_masked_matmul(T_, S, static):
    gen = torch.Generator().manual_seed(S + T_)
    n_ctx = S - 100 if static else S
    positions = torch.arange(n_ctx - T_, n_ctx)
    q = torch.randn(T_, 8, 128, generator=gen)
    keys, values = torch.randn(S, 2, 128, generator=gen), torch.randn(S, 2, 128, generator=gen)
    want = masked_reference(q, keys, values, positions)
    got = sdpa_attention(q.to(DEV), keys.to(DEV), values.to(DEV), positions.to(DEV), static)
    assert rel(got, want) < 1e-5
    got = sdpa_attention(q.to(DEV, torch.bfloat16), keys.to(DEV, torch.bfloat16), values.to(DEV, torch.bfloat16),
                         positions.to(DEV), static)
    assert rel(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_norm_and_rope_match_the_torch_formulas(dtype):
    """``rms_norm`` / ``norm_rope`` on CUDA (one Triton kernel each) against the torch formulas the CPU
    runs, on the same device; positions up to 32K: at ~3e4 rad a 1-ulp difference of a float32
    frequency moves the angle by ~2e-3, hence 1e-3 in float32 (seen: 2.1e-4)."""
    from strata_core.model import ops

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(33, 2048, generator=gen).to(DEV, dtype)
    w = torch.randn(2048, generator=gen).to(DEV, dtype)
    q = torch.randn(6, 32, 128, generator=gen).to(DEV, dtype)
    qw = torch.randn(128, generator=gen).to(DEV, dtype)
    positions = torch.tensor([0, 1, 17, 1000, 8191, 32767], device=DEV)
    yarn = (scaled_inv_freq(128, 1e6, "yarn", 4.0, 8192).to(DEV), 1.2)  # a scaled RoPE's table and factor
    fused = [ops.rms_norm(x, w, 1e-6), ops.norm_rope(q, positions, 1e6, qw, 1e-6),
             ops.norm_rope(q, positions[:1].expand(6), 1e4, None, 0.0), ops.norm_rope(q, positions, 1e6, qw, 1e-6,
                                                                                       True, *yarn)]
    plain = [ops.rms_norm(x, w, 1e-6, fused=False), ops.norm_rope(q, positions, 1e6, qw, 1e-6, fused=False),
             ops.norm_rope(q, positions[:1].expand(6), 1e4, None, 0.0, fused=False),
             ops.norm_rope(q, positions, 1e6, qw, 1e-6, False, *yarn)]
    for got, want in zip(fused, plain):
        assert got.dtype == dtype and got.shape == want.shape
        assert rel(got, want) < (1e-3 if dtype == torch.float32 else 1e-2)
