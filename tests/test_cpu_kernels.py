"""The CPU expert kernels (``strata::qlinear_grouped``, ``strata::qlinear_slots``) against the reference
dequantize + matmul, and against one another.

Tolerance: the float bodies within float32's (a relative 1e-5); the int8 body (AVX-512 VNNI) within the
CUDA q8 kernels' relative (Frobenius) 2e-2 (tests/test_moe_q8.py): its activations are rounded to int8 per
32 values as theirs are, and with that rounding replayed here its results are the float32 product's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.experts.backend import _cpu_pool
from strata_core.ops.cpu_kernels import (CPU_INT8_TYPES, CPU_KERNEL_TYPES, INT8_ISA, cpu_kernels, dequantize_blocks,
                                         combine_cpu, int8_activations, linear_cpu, qlinear_grouped, qlinear_slots,
                                         route_cpu, route_slot_ffn_cpu, silu_mul_cpu, slot_ffn_cpu)
from strata_core.quant.registry import dequantize_reference
from strata_core.quant import dequantize, random_blocks
from strata_core.testing.cpu_isa import FLOAT_ISA, cpu_isa_at_most

TYPES = sorted(CPU_KERNEL_TYPES)
Q8_TOL = 2e-2  # the CUDA q8 kernels' (tests/test_moe_q8.py)

pytestmark = pytest.mark.skipif(not cpu_kernels(), reason="the CPU kernels did not build (see the warning)")
needs_int8 = pytest.mark.skipif(not cpu_kernels() or torch.ops.strata.cpu_kernel_isa() < INT8_ISA,
                                reason="no AVX-512 VNNI here")


def _q8(x: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` rounded as the int8 body quantizes it: each 32 values to int8 codes of ``max |v| / 127``
    (half away from zero), the codes times that scale."""
    v = x.reshape(x.shape[0], x.shape[1] // 32, 32)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax  # a true division (``127.0 / amax`` multiplies by a reciprocal)
    scaled = v * torch.where(amax > 0, inv, torch.zeros_like(amax))
    codes = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).trunc()
    return (codes * (amax / 127.0)).reshape(x.shape)


def _mins(raw: torch.Tensor, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    """The min terms of Q4_K / Q5_K blocks (``-dmin * min`` of each value: the blocks' codes zeroed), zeros
    for the other formats: the part of the weights the int8 body multiplies by the values themselves."""
    if qtype not in (T.Q4_K, T.Q5_K):
        return torch.zeros(shape)
    blocks = raw.clone().reshape(-1, GGML_QUANT_SIZES[qtype][1])
    blocks[:, 16:] = 0  # Q5_K's fifth bits and the codes (Q4_K: the codes)
    return dequantize(blocks.reshape(-1), qtype, shape)


def _weight(qtype: T, out: int, blocks_per_row: int, rng: np.random.Generator) -> tuple[torch.Tensor, int]:
    """Random ``[out, in]`` blocks as a uint8 ``[out * row_bytes]`` tensor, and ``in``."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, out * blocks_per_row, rng, scale=0.1)
    return torch.from_numpy(raw).reshape(-1), blocks_per_row * block_size


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), counts=st.lists(st.integers(0, 19), min_size=1, max_size=4),
       out=st.integers(1, 40), blocks=st.integers(1, 3))
def test_grouped_product_matches_the_reference(qtype: T, seed: int, counts: list[int], out: int, blocks: int) -> None:
    """The float body: every segment's rows equal ``x @ dequantize(W).T`` within the CUDA kernels' float32
    tolerance."""
    rng = np.random.default_rng(seed)
    weights, K = zip(*(_weight(qtype, out, blocks, rng) for _ in counts))
    x = torch.from_numpy(rng.standard_normal((sum(counts), K[0]), dtype=np.float32))
    with cpu_isa_at_most(FLOAT_ISA):
        got = qlinear_grouped(x, list(weights), counts, qtype, out)
    want = torch.cat([xs @ dequantize(w, qtype, (out, K[0])).T for xs, w in zip(x.split(counts), weights)])
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, scale))


@needs_int8
@pytest.mark.parametrize("qtype", sorted(CPU_INT8_TYPES), ids=lambda t: t.name)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), counts=st.lists(st.integers(0, 19), min_size=1, max_size=4),
       out=st.integers(1, 40), blocks=st.integers(1, 3), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       zeros=st.booleans())
def test_the_int8_body_matches_the_reference_within_the_q8_tolerance(qtype: T, seed: int, counts: list[int], out: int,
                                                                    blocks: int, scale: float, zeros: bool) -> None:
    """The int8 body: every segment's rows within the CUDA q8 tolerance of ``x @ dequantize(W).T``, and, with
    the activations rounded as it rounds them (``_q8``; Q4_K / Q5_K's mins against the values themselves),
    the float32 product's within float32's: activation rounding is its only approximation. Rows of any
    magnitude; with ``zeros`` blocks of 32 zeros (a zero scale) among them."""
    rng = np.random.default_rng(seed)
    weights, K = zip(*(_weight(qtype, out, blocks, rng) for _ in counts))
    x = torch.from_numpy(rng.standard_normal((sum(counts), K[0]), dtype=np.float32)) * scale
    if zeros:
        x[::2, :32] = 0.0
    assert int8_activations([qtype])
    got = qlinear_grouped(x, list(weights), counts, qtype, out)
    parts = [(xs, dequantize(w, qtype, (out, K[0])), _mins(w, qtype, (out, K[0]))) for xs, w in zip(x.split(counts), weights)]
    want = torch.cat([xs.double() @ w.double().T for xs, w, _ in parts])
    if want.numel() and want.norm() > 0:
        assert ((got.double() - want).norm() / want.norm()).item() < Q8_TOL
    replayed = torch.cat([_q8(xs).double() @ w.double().T + (xs - _q8(xs)).double() @ m.double().T for xs, w, m in parts])
    bound = replayed.abs().max().item() if replayed.numel() else 1.0
    torch.testing.assert_close(got.double(), replayed, rtol=1e-5, atol=1e-5 * max(1e-30, bound))


def test_int8_activations_says_which_formats_take_the_int8_body() -> None:
    best = torch.ops.strata.cpu_kernel_isa()
    assert int8_activations([T.Q4_K]) == (best >= INT8_ISA)
    assert int8_activations([T.IQ4_XS, T.Q8_0]) == (best >= INT8_ISA)
    assert int8_activations([T.IQ4_XS, T.MXFP4]) == (best >= INT8_ISA)
    assert not int8_activations([T.Q2_K])
    with cpu_isa_at_most(FLOAT_ISA):
        assert not int8_activations([T.Q4_K])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(TYPES), n=st.integers(1, 21), threads=st.integers(1, 5))
def test_a_rows_bits_do_not_depend_on_the_batch(seed: int, qtype: T, n: int, threads: int) -> None:
    """A token's row is the same bits alone, in a batch of ``n``, split per pair, with any thread count
    (more threads than cores too: each item is claimed by whichever thread comes first); the int8 body's
    where it runs (each row quantized by itself)."""
    rng = np.random.default_rng(seed)
    w, K = _weight(qtype, 24, 2, rng)
    x = torch.from_numpy(rng.standard_normal((n, K), dtype=np.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = qlinear_grouped(x, [w], [n], qtype, 24)
        pairs = qlinear_grouped(x, [w] * n, [1] * n, qtype, 24)
    finally:
        torch.set_num_threads(before)
    alone = qlinear_grouped(x[-1:], [w], [1], qtype, 24)
    assert torch.equal(batch, pairs) and torch.equal(batch[-1:], alone)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(TYPES), tokens=st.integers(1, 9), rep=st.integers(1, 4),
       n_slots=st.integers(1, 5), out=st.integers(1, 40), threads=st.integers(1, 2))
def test_slot_products_are_the_grouped_products_of_each_pair(seed: int, qtype: T, tokens: int, rep: int, n_slots: int,
                                                             out: int, threads: int) -> None:
    """``qlinear_slots``: pair p's columns of matrix m are the bits ``qlinear_grouped`` gives token ``p // rep``
    alone against that matrix in its slot, for any routing of pairs to slots and any thread count."""
    rng = np.random.default_rng(seed)
    mats = [[_weight(qtype, out, 2, rng)[0] for _ in range(2)] for _ in range(n_slots)]
    K = 2 * GGML_QUANT_SIZES[qtype][0]
    nbytes = mats[0][0].numel()
    pad = int(rng.integers(0, 9))  # a slot row may be longer than the matrices it holds
    buffer = torch.stack([torch.cat([*pair, torch.zeros(pad, dtype=torch.uint8)]) for pair in mats])  # [S, 2m + pad]
    slot = torch.from_numpy(rng.integers(0, n_slots, tokens * rep))
    x = torch.from_numpy(rng.standard_normal((tokens, K), dtype=np.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = qlinear_slots(x, rep, buffer, slot, [0, nbytes], qtype, out)
    finally:
        torch.set_num_threads(before)
    want = torch.cat([torch.cat([qlinear_grouped(x[p // rep:p // rep + 1], [mats[s][m]], [1], qtype, out)
                                 for m in range(2)], dim=1) for p, s in enumerate(slot.tolist())])
    assert torch.equal(got, want)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gate_up=st.sampled_from(TYPES), down=st.sampled_from(TYPES),
       split=st.booleans(), tokens=st.integers(1, 9), rep=st.integers(1, 4), n_slots=st.integers(1, 5),
       threads=st.integers(1, 2))
def test_a_slot_ffn_is_its_products_and_activation(seed: int, gate_up: T, down: T, split: bool, tokens: int, rep: int,
                                                   n_slots: int, threads: int) -> None:
    """``slot_ffn_cpu``: the bits of ``qlinear_slots`` (gate and up), ``silu_mul_cpu`` and ``qlinear_slots`` (down)
    called one after another, gate and up of one format or two, for any routing and thread count."""
    rng = np.random.default_rng(seed)
    up = TYPES[(TYPES.index(gate_up) + 1) % len(TYPES)] if split else gate_up
    H, F = 256, 2 * GGML_QUANT_SIZES[down][0]  # rows of whole blocks in every format
    qtypes = (gate_up, up, down)

    def expert() -> torch.Tensor:
        parts = [_weight(gate_up, F, H // GGML_QUANT_SIZES[gate_up][0], rng)[0],
                 _weight(up, F, H // GGML_QUANT_SIZES[up][0], rng)[0], _weight(down, H, 2, rng)[0]]
        return torch.cat([*parts, torch.zeros(3, dtype=torch.uint8)]), [p.numel() for p in parts]

    experts = [expert() for _ in range(n_slots)]
    g_bytes, u_bytes, _ = experts[0][1]
    buffer = torch.stack([e for e, _ in experts])
    slot = torch.from_numpy(rng.integers(0, n_slots, tokens * rep))
    x = torch.from_numpy(rng.standard_normal((tokens, H), dtype=np.float32))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = slot_ffn_cpu(x, rep, buffer, slot, (0, g_bytes, g_bytes + u_bytes), qtypes, F)
    finally:
        torch.set_num_threads(before)
    g = qlinear_slots(x, rep, buffer, slot, [0], gate_up, F)
    u = qlinear_slots(x, rep, buffer, slot, [g_bytes], up, F)
    want = qlinear_slots(silu_mul_cpu(g, u), 1, buffer, slot, [g_bytes + u_bytes], down, H)
    assert torch.equal(got, want)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), qtype=st.sampled_from(TYPES), tokens=st.integers(1, 6),
       n_experts=st.integers(1, 9), k=st.integers(1, 4), norm=st.booleans(), threads=st.integers(1, 2))
def test_a_routed_slot_ffn_is_the_router_the_routing_the_slot_ffn_and_the_combine(
        seed: int, qtype: T, tokens: int, n_experts: int, k: int, norm: bool, threads: int) -> None:
    """``route_slot_ffn_cpu``: the bits of ``linear_cpu`` (the router), ``route_cpu``, the slot lookup, ``slot_ffn_cpu``
    and ``combine_cpu`` called one after another; the usage counts gain one a pair."""
    rng = np.random.default_rng(seed)
    k = min(k, n_experts)
    H, F = 256, 2 * GGML_QUANT_SIZES[qtype][0]
    blocks = H // GGML_QUANT_SIZES[qtype][0]
    parts = [[_weight(qtype, F, blocks, rng)[0] for _ in range(2)] + [_weight(qtype, H, 2, rng)[0]]
             for _ in range(n_experts)]
    g_bytes, u_bytes, _ = (p.numel() for p in parts[0])
    buffer = torch.stack([torch.cat(p) for p in parts])  # [S, stride]: expert e in slot slots[e]
    slots = torch.from_numpy(rng.permutation(n_experts)).long()
    buffer = buffer[torch.argsort(slots)].contiguous()
    x = torch.from_numpy(rng.standard_normal((tokens, H), dtype=np.float32))
    router = torch.from_numpy(rng.standard_normal((n_experts, H), dtype=np.float32))
    counts = torch.from_numpy(rng.integers(0, 5, n_experts))
    before, offsets, qtypes = counts.clone(), (0, g_bytes, g_bytes + u_bytes), (qtype,) * 3
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ids = route_slot_ffn_cpu(x, router, k, norm, 1.5, 6.1e-5, slots, counts, buffer, offsets, qtypes, F)
    finally:
        torch.set_num_threads(threads_before)
    want_ids, weights = route_cpu(linear_cpu(x, router), k, norm, 1.5, 6.1e-5)
    rows = slot_ffn_cpu(x, k, buffer, slots[want_ids.view(-1)], offsets, qtypes, F)
    assert torch.equal(ids, want_ids)
    assert torch.equal(out, combine_cpu(rows.view(tokens, k, H), weights))
    assert torch.equal(counts, before + torch.bincount(ids.view(-1), minlength=n_experts))


def test_a_routed_slot_ffn_checks_the_slots_before_counting() -> None:
    rng = np.random.default_rng(1)
    expert = torch.cat([_weight(T.Q8_0, 64, 8, rng)[0] for _ in range(2)] + [_weight(T.Q8_0, 256, 2, rng)[0]])
    n = expert.numel() // 3
    counts = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="slot outside the 1 rows"):  # expert 1 in slot 5 of a buffer of 1
        route_slot_ffn_cpu(torch.randn(1, 256), torch.randn(2, 256), 2, True, 1.0, 6.1e-5, torch.tensor([0, 5]),
                           counts, expert[None], (0, n, 2 * n), (int(T.Q8_0),) * 3, 64)
    assert not counts.any()
    with pytest.raises(ValueError, match="do not fit"):
        route_slot_ffn_cpu(torch.randn(1, 256), torch.randn(2, 256), 1, True, 1.0, 6.1e-5, torch.tensor([0, 0]),
                           counts, expert[None], (0, n, 2 * n + 8), (int(T.Q8_0),) * 3, 64)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 30), F=st.integers(1, 300), split=st.integers(0, 30))
def test_silu_mul_matches_the_formula_and_rows_are_their_own(seed: int, rows: int, F: int, split: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, F, generator=g) * 6, torch.randn(rows, F, generator=g)
    got = silu_mul_cpu(gate, up)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    split = min(split, rows)
    assert torch.equal(torch.cat((silu_mul_cpu(gate[:split], up[:split]), silu_mul_cpu(gate[split:], up[split:]))), got)
    assert torch.equal(silu_mul_cpu(gate[:, :1], up[:, :1]), got[:, :1])  # an element alone: the same bits
    best = torch.ops.strata.cpu_kernel_isa()
    try:
        for isa in range(best):
            torch.ops.strata.cpu_kernel_limit_isa(isa)
            assert torch.equal(silu_mul_cpu(gate, up), got)
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)


def test_opcheck_slot_ffn_and_silu_mul() -> None:
    rng = np.random.default_rng(0)
    buffer = torch.stack([torch.cat([_weight(T.Q8_0, 64, 8, rng)[0], _weight(T.Q8_0, 64, 8, rng)[0],
                                     _weight(T.Q8_0, 256, 2, rng)[0]]) for _ in range(2)])  # two experts
    n = buffer.shape[1] // 3  # gate, up and down take the same bytes here
    torch.library.opcheck(torch.ops.strata.slot_ffn_cpu.default,
                          (torch.randn(2, 256), 2, buffer, torch.tensor([1, 0, 1, 1]), [0, n, 2 * n],
                           [int(T.Q8_0)] * 3, 64))
    torch.library.opcheck(torch.ops.strata.silu_mul_cpu.default, (torch.randn(3, 20), torch.randn(3, 20)))
    torch.library.opcheck(torch.ops.strata.route_slot_ffn_cpu.default,
                          (torch.randn(2, 256), torch.randn(2, 256), 2, True, 1.0, 6.1e-5, torch.tensor([1, 0]),
                           torch.zeros(2, dtype=torch.long), buffer, [0, n, 2 * n], [int(T.Q8_0)] * 3, 64))


def test_opcheck_qlinear_slots() -> None:
    rng = np.random.default_rng(0)
    (w, K), (v, _) = _weight(T.Q4_K, 8, 1, rng), _weight(T.Q4_K, 8, 1, rng)
    buffer = torch.stack([w, v])
    torch.library.opcheck(torch.ops.strata.qlinear_slots.default,
                          (torch.randn(2, K), 2, buffer, torch.tensor([1, 0, 1, 1]), [0], int(T.Q4_K), 8))


def test_bad_slot_arguments_are_errors_with_messages() -> None:
    rng = np.random.default_rng(0)
    w, K = _weight(T.Q8_0, 4, 1, rng)
    buffer, x = w[None], torch.randn(2, K)
    with pytest.raises(ValueError, match="3 pairs for x"):
        qlinear_slots(x, 1, buffer, torch.zeros(3, dtype=torch.long), [0], T.Q8_0, 4)
    with pytest.raises(ValueError, match="do not fit rows"):
        qlinear_slots(x, 1, buffer, torch.zeros(2, dtype=torch.long), [1], T.Q8_0, 4)
    with pytest.raises(ValueError, match="no CPU kernel for Q2_K"):
        qlinear_slots(x, 1, buffer, torch.zeros(2, dtype=torch.long), [0], T.Q2_K, 4)


def test_opcheck_qlinear_grouped() -> None:
    rng = np.random.default_rng(0)
    w, K = _weight(T.Q4_K, 8, 1, rng)
    x = torch.randn(3, K)
    torch.library.opcheck(torch.ops.strata.qlinear_grouped.default, (x, [w, w], [1, 2], int(T.Q4_K), 8))


def test_bad_arguments_are_errors_with_messages() -> None:
    rng = np.random.default_rng(0)
    w, K = _weight(T.Q8_0, 4, 1, rng)
    x = torch.randn(2, K)
    with pytest.raises(ValueError, match="counts sum to 1"):
        qlinear_grouped(x, [w], [1], T.Q8_0, 4)
    with pytest.raises(ValueError, match="expected"):
        qlinear_grouped(x, [w], [2], T.Q8_0, 5)
    with pytest.raises(ValueError, match="no CPU kernel for Q2_K"):
        qlinear_grouped(x, [w], [2], T.Q2_K, 4)


@pytest.mark.skipif(torch.ops.strata.cpu_kernel_isa() < 2 if cpu_kernels() else True, reason="no AVX-512 here")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_avx2_body_gives_the_avx512_bits(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    w, K = _weight(qtype, 40, 2, rng)
    x = torch.from_numpy(rng.standard_normal((11, K), dtype=np.float32))
    with cpu_isa_at_most(2):
        wide = qlinear_grouped(x, [w], [11], qtype, 40)
    with cpu_isa_at_most(1):
        assert torch.equal(qlinear_grouped(x, [w], [11], qtype, 40), wide)


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from(sorted(CPU_KERNEL_TYPES)), n_blocks=st.integers(1, 3000), seed=st.integers(0, 1 << 16))
def test_the_block_decoders_give_the_reference_s_bits(qtype: int, n_blocks: int, seed: int) -> None:
    """``dequantize_blocks`` (what ``strata::dequantize`` runs on the CPU) writes the torch reference's
    float32 values bit for bit (the sign of a zero too), threaded over the blocks."""
    values, size = GGML_QUANT_SIZES[T(qtype)]
    raw = torch.from_numpy(random_blocks(qtype, n_blocks, np.random.default_rng(seed))).reshape(-1)
    got = dequantize_blocks(raw, qtype)
    want = dequantize_reference(raw, qtype, [n_blocks * values])
    assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(dequantize(raw, qtype, [n_blocks * values]).view(torch.int32), want.view(torch.int32))


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from(sorted(CPU_KERNEL_TYPES)), n_blocks=st.integers(1, 5000), seed=st.integers(0, 1 << 16),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_values_written_as_16_bit_floats_are_the_float32_values_rounded(qtype: int, n_blocks: int, seed: int,
                                                                        dtype: torch.dtype) -> None:
    """``dequantize_blocks`` in bfloat16 / float16 (the dense weights' load) gives the float32 values'
    ``.to(dtype)`` bit for bit, across its inner chunks of blocks and its threads; so does ``strata::dequantize``'s
    dtype."""
    values, _ = GGML_QUANT_SIZES[T(qtype)]
    raw = torch.from_numpy(random_blocks(qtype, n_blocks, np.random.default_rng(seed))).reshape(-1)
    want = dequantize_reference(raw, qtype, [n_blocks * values]).to(dtype)
    got = dequantize_blocks(raw, qtype, dtype)
    assert got is not None and got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(dequantize(raw, qtype, [n_blocks * values], dtype).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=["generic", "AVX2", "AVX-512", "AVX-512 VNNI"])
def test_a_negative_zero_scale_keeps_its_sign_in_every_body(isa: int) -> None:
    """A Q8_0 block scaled by -0.0 decodes to the reference's signed zeros, whichever body runs (the
    scale is broadcast to the lanes as it is: ``splat`` in csrc/cpu_lanes.h)."""
    codes = np.arange(-16, 16, dtype=np.int8)
    raw = torch.from_numpy(np.concatenate([np.array([0x00, 0x80], np.uint8), codes.view(np.uint8)]))  # d = -0.0
    want = dequantize_reference(raw, T.Q8_0, [32])
    best = torch.ops.strata.cpu_kernel_isa()
    if isa > best:
        pytest.skip("this CPU lacks that instruction set")
    try:
        assert torch.ops.strata.cpu_kernel_limit_isa(isa) == isa
        got = dequantize_blocks(raw, T.Q8_0)
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)
    assert torch.signbit(want).any() and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("threads", [1, 3])
def test_the_cpu_share_s_worker_runs_the_kernels_on_its_threads(threads: int) -> None:
    """``torch.set_num_threads`` in the initializer of a GPU's CPU-share worker (``backend._cpu_pool``) sets
    how many threads the kernels' parallel regions run there (torch and the kernels share one OpenMP
    runtime); the calling thread keeps its own count."""
    here = torch.ops.strata.cpu_kernel_threads()
    pool = _cpu_pool(threads)
    try:
        assert pool.submit(torch.ops.strata.cpu_kernel_threads).result() == threads
    finally:
        pool.shutdown()
    assert torch.ops.strata.cpu_kernel_threads() == here
