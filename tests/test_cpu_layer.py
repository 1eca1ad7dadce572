"""The CPU's float32 layer ops (csrc/cpu_layer.cpp) against their torch formulas, each row's bits its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.model.ops import apply_rope, rope_cos_sin
from strata_core.ops.cpu_kernels import (add_rms_norm_cpu, combine_cpu, cpu_kernels, norm_rope_cpu, qkv_rope_cpu,
                                        rms_norm_cpu, route_cpu)

pytestmark = pytest.mark.skipif(not cpu_kernels(), reason="the CPU kernels did not build (see the warning)")

_MIN_SUM = 6.103515625e-5


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model/ops.py's torch formula (what ``rms_norm`` computes off the CPU kernels)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _route_ref(logits: torch.Tensor, k: int, norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(_MIN_SUM)
    return ids, weights * scale


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


def _threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@given(T=st.integers(1, 70), D=st.integers(1, 300), split=st.integers(0, 70), threads=st.integers(1, 2),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_rms_norm_matches_the_formula_and_rows_are_their_own(T, D, split, threads, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, D, generator=g) * 3, torch.randn(D, generator=g)
    whole = _threads(threads, lambda: rms_norm_cpu(x, w, 1e-6))
    assert _close(whole, _rms_norm_ref(x.double(), w.double(), 1e-6))
    split = min(split, T)
    assert torch.equal(torch.cat((rms_norm_cpu(x[:split], w, 1e-6), rms_norm_cpu(x[split:], w, 1e-6))), whole)
    assert torch.equal(rms_norm_cpu(x.view(T, 1, D), w, 1e-6).view(T, D), whole)  # any leading dims


@given(T=st.integers(1, 40), heads=st.integers(1, 9), half=st.integers(1, 80), normed=st.booleans(),
       scaled=st.booleans(), split=st.integers(0, 40), threads=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
@settings(max_examples=30, deadline=None)
def test_norm_rope_matches_the_formulas_and_reads_a_view_in_place(T, heads, half, normed, scaled, split, threads,
                                                                   seed):
    D = 2 * half
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(T, (heads + 3) * D, generator=g)  # a q/k/v product's rows: the heads are a view
    x = fused[:, D:D + heads * D].view(T, heads, D)
    w = torch.randn(D, generator=g) if normed else None
    positions = torch.randint(0, 40_000, (T,), generator=g)
    theta = 1e6
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    mscale = 1.0
    if scaled:  # a scaled RoPE's own angles and attention factor
        inv_freq, mscale = inv_freq * torch.rand(half, generator=g), 1.25
    whole = _threads(threads, lambda: norm_rope_cpu(x, w, 1e-6, positions, inv_freq, mscale))
    ref = x.double() if w is None else _rms_norm_ref(x.double(), w.double(), 1e-6)
    cos, sin = rope_cos_sin(positions, D, theta, inv_freq, mscale)
    assert _close(whole, apply_rope(ref, cos.double(), sin.double()))
    assert whole.is_contiguous() and whole.shape == (T, heads, D)
    assert torch.equal(norm_rope_cpu(x.contiguous(), w, 1e-6, positions, inv_freq, mscale), whole)
    split = min(split, T)
    parts = [norm_rope_cpu(x[a:b], w, 1e-6, positions[a:b], inv_freq, mscale) for a, b in ((0, split), (split, T))]
    assert torch.equal(torch.cat(parts), whole)


@given(T=st.integers(1, 40), E=st.integers(1, 140), k=st.integers(1, 10), norm=st.booleans(),
       scale=st.sampled_from([1.0, 2.5]), split=st.integers(0, 40), threads=st.integers(1, 2),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=30, deadline=None)
def test_route_matches_softmax_topk_and_renormalisation(T, E, k, norm, scale, split, threads, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 4
    ids, weights = _threads(threads, lambda: route_cpu(logits, k, norm, scale, _MIN_SUM))
    assert ids.dtype == torch.long and weights.dtype == torch.float32 and ids.shape == weights.shape == (T, k)
    ref_ids, ref_weights = _route_ref(logits.double(), k, norm, scale)
    probs = torch.softmax(logits.double(), dim=-1)
    # the chosen experts are the k most probable (an exchanged near-tie picks the same probabilities)
    assert torch.allclose(probs.gather(1, ids), probs.gather(1, ref_ids), rtol=1e-5, atol=1e-7)
    assert all(len(set(row)) == k for row in ids.tolist())
    assert _close(weights, ref_weights)
    split = min(split, T)
    parts = [route_cpu(logits[a:b], k, norm, scale, _MIN_SUM) for a, b in ((0, split), (split, T))]
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1] for p in parts]), weights)


def test_route_breaks_ties_by_the_lower_expert_and_clamps_the_sum():
    ids, weights = route_cpu(torch.zeros(1, 6), 3, True, 1.0, _MIN_SUM)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(weights, torch.full((1, 3), 1 / 3))
    _, weights = route_cpu(torch.tensor([[0.0, -200.0, -200.0]]), 2, True, 1.0, _MIN_SUM)  # the top-2 sum is 1
    _, clamped = route_cpu(torch.tensor([[200.0, 0.0, 0.0]]), 2, True, 1.0, 2.0)  # the sum 1 clamped up to 2
    assert weights[0, 0] == 1.0 and clamped[0, 0] == 0.5


@given(T=st.integers(1, 40), k=st.integers(1, 9), H=st.integers(1, 300), residual=st.booleans(),
       split=st.integers(0, 40), threads=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_combine_sums_the_rows_in_k_order(T, k, H, residual, split, threads, seed):
    g = torch.Generator().manual_seed(seed)
    rows, weights = torch.randn(T, k, H, generator=g), torch.rand(T, k, generator=g)
    h = torch.randn(T, H, generator=g) if residual else None
    whole = _threads(threads, lambda: combine_cpu(rows, weights, h))
    folded = rows[:, 0] * weights[:, :1]  # the order the op documents, in torch
    for j in range(1, k):
        folded = folded + rows[:, j] * weights[:, j:j + 1]
    assert torch.equal(whole, folded if h is None else h + folded)
    want = (rows.double() * weights.double()[..., None]).sum(1)
    assert _close(whole, want if h is None else want + h.double())
    split = min(split, T)
    parts = [combine_cpu(rows[a:b], weights[a:b], None if h is None else h[a:b]) for a, b in ((0, split), (split, T))]
    assert torch.equal(torch.cat(parts), whole)


@given(T=st.integers(1, 40), H=st.integers(1, 300), split=st.integers(0, 40), threads=st.integers(1, 2),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_add_rms_norm_is_the_add_then_the_norm(T, H, split, threads, seed):
    g = torch.Generator().manual_seed(seed)
    h, delta, w = torch.randn(T, H, generator=g) * 3, torch.randn(T, H, generator=g), torch.randn(H, generator=g)
    total, normed = _threads(threads, lambda: add_rms_norm_cpu(h, delta, w, 1e-6))
    assert torch.equal(total, h + delta)  # the bits of the two ops it joins
    assert torch.equal(normed, rms_norm_cpu(h + delta, w, 1e-6))
    assert _close(normed, _rms_norm_ref((h + delta).double(), w.double(), 1e-6))
    split = min(split, T)
    parts = [add_rms_norm_cpu(h[a:b], delta[a:b], w, 1e-6) for a, b in ((0, split), (split, T))]
    assert torch.equal(torch.cat([p[0] for p in parts]), total)
    assert torch.equal(torch.cat([p[1] for p in parts]), normed)


def _qkv_case(g: torch.Generator, T: int, nh: int, nkv: int, D: int, normed: bool):
    """A q/k/v product's rows (a strided view, as the fused product's columns are), the norms and angles."""
    qkv = torch.randn(T, (nh + 2 * nkv) * D + 5, generator=g)[:, 5:]
    wq, wk = (torch.randn(D, generator=g), torch.randn(D, generator=g)) if normed else (None, None)
    return qkv, wq, wk, torch.rand(D // 2, generator=g)


@given(T=st.integers(1, 12), nh=st.integers(1, 6), nkv=st.integers(1, 3), half=st.integers(1, 40),
       normed=st.booleans(), scaled=st.booleans(), threads=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
@settings(max_examples=30, deadline=None)
def test_qkv_rope_is_norm_rope_and_the_kv_write(T, nh, nkv, half, normed, scaled, threads, seed):
    D = 2 * half
    g = torch.Generator().manual_seed(seed)
    qkv, wq, wk, inv_freq = _qkv_case(g, T, nh, nkv, D, normed)
    mscale = 1.25 if scaled else 1.0
    positions = torch.randperm(3 * T, generator=g)[:T]  # any positions, each at most once
    row_ids = torch.randperm(4 * T, generator=g)[:3 * T]  # a position's row in pools of 4T rows
    keys, values = torch.full((2 * T, 2, nkv, D), 7.0), torch.full((2 * T, 2, nkv, D), 7.0)  # [blocks, 2, nkv, D]
    q = _threads(threads, lambda: qkv_rope_cpu(qkv, wq, wk, 1e-6, positions, inv_freq, mscale, nh, nkv, keys, values,
                                               row_ids))
    q_size, kv_size = nh * D, nkv * D
    k = norm_rope_cpu(qkv[:, q_size:q_size + kv_size].view(T, nkv, D), wk, 1e-6, positions, inv_freq, mscale)
    assert torch.equal(q, norm_rope_cpu(qkv[:, :q_size].view(T, nh, D), wq, 1e-6, positions, inv_freq, mscale))
    want_k, want_v = torch.full((4 * T, nkv, D), 7.0), torch.full((4 * T, nkv, D), 7.0)
    want_k.index_copy_(0, row_ids[positions], k)  # the cache's write (kvcache.py ``_store``)
    want_v.index_copy_(0, row_ids[positions], qkv[:, q_size + kv_size:].reshape(T, nkv, D))
    assert torch.equal(keys.view(4 * T, nkv, D), want_k) and torch.equal(values.view(4 * T, nkv, D), want_v)


def test_qkv_rope_checks_every_row_before_writing():
    g = torch.Generator().manual_seed(3)
    qkv, wq, wk, inv_freq = _qkv_case(g, 2, 2, 1, 8, True)
    keys, values = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    for positions, row_ids, what in ((torch.tensor([0, 5]), torch.arange(4), "a position outside the 4 row ids"),
                                     (torch.tensor([0, 1]), torch.tensor([1, 4]), "a row outside the 4 rows")):
        with pytest.raises(ValueError, match=what):
            qkv_rope_cpu(qkv, wq, wk, 1e-6, positions, inv_freq, 1.0, 2, 1, keys, values, row_ids)
        assert not keys.any() and not values.any()


def test_the_bodies_give_the_same_bits():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 517, generator=g), torch.randn(517, generator=g)
    qk, qw = torch.randn(9, 5, 80, generator=g), torch.randn(80, generator=g)
    positions, inv_freq = torch.arange(100, 109), torch.rand(40, generator=g)
    logits, rows, weights = torch.randn(9, 70, generator=g), torch.randn(9, 6, 517, generator=g), torch.rand(9, 6)

    qkv, keys, values = torch.randn(9, 7 * 80, generator=g), torch.zeros(9, 1, 80), torch.zeros(9, 1, 80)

    def run():
        q = qkv_rope_cpu(qkv, qw, qw, 1e-6, positions - 100, inv_freq, 1.0, 5, 1, keys, values, torch.arange(9))
        return (rms_norm_cpu(x, w, 1e-6), norm_rope_cpu(qk, qw, 1e-6, positions, inv_freq, 1.0),
                *route_cpu(logits, 6, True, 1.0, _MIN_SUM), combine_cpu(rows, weights, x),
                *add_rms_norm_cpu(x, x, w, 1e-6), q, keys.clone(), values.clone())

    want = run()
    best = torch.ops.strata.cpu_kernel_isa()
    try:
        for isa in range(best):
            assert torch.ops.strata.cpu_kernel_limit_isa(isa) == isa
            assert all(torch.equal(a, b) for a, b in zip(run(), want))
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)


def test_opcheck_the_layer_ops():
    ops = torch.ops.strata
    torch.library.opcheck(ops.rms_norm_cpu.default, (torch.randn(3, 20), torch.randn(20), 1e-6))
    torch.library.opcheck(ops.norm_rope_cpu.default, (torch.randn(3, 2, 16), torch.randn(16), 1e-6,
                                                      torch.arange(3), torch.rand(8), 1.0))
    torch.library.opcheck(ops.norm_rope_cpu.default, (torch.randn(3, 2, 16), None, 1e-6, torch.arange(3),
                                                      torch.rand(8), 1.0))
    torch.library.opcheck(ops.route_cpu.default, (torch.randn(3, 20), 4, True, 1.0, _MIN_SUM))
    torch.library.opcheck(ops.combine_cpu.default, (torch.randn(3, 4, 20), torch.rand(3, 4), torch.randn(3, 20)))
    torch.library.opcheck(ops.combine_cpu.default, (torch.randn(3, 4, 20), torch.rand(3, 4), None))
    torch.library.opcheck(ops.add_rms_norm_cpu.default, (torch.randn(3, 20), torch.randn(3, 20), torch.randn(20), 1e-6))
    torch.library.opcheck(ops.qkv_rope_cpu.default, (torch.randn(3, 4 * 16), torch.randn(16), None, 1e-6,
                                                     torch.arange(3), torch.rand(8), 1.0, 2, 1, torch.zeros(2, 4, 1, 16),
                                                     torch.zeros(2, 4, 1, 16), torch.arange(8)))
