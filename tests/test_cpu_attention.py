"""``strata::attention_cpu``: the CPU's attention against a float64 reference, and each row's bits its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops.cpu_kernels import attention_cpu, cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels(), reason="the CPU kernels did not build (see the warning)")


def _naive(q, keys, values, positions, window, sinks):
    """Float64 softmax attention with the keys repeated per query head."""
    T, nh, D = q.shape
    S, nkv = keys.shape[:2]
    k = keys.double().repeat_interleave(nh // nkv, 1)
    v = values.double().repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * D ** -0.5
    offset = positions[:, None] - torch.arange(S)[None, :]
    visible = (offset >= 0) & (offset < window) if window else offset >= 0
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None, None].expand(nh, T, 1)), dim=-1)
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1)[..., :S], v).reshape(T, nh * D)


@given(S=st.integers(1, 300), T=st.integers(1, 6), nkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 3]),
       D=st.sampled_from([9, 16, 64]), window=st.sampled_from([None, 4, 100]), sinks=st.booleans(),
       extra=st.integers(0, 40), seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_rows_match_the_reference_and_do_not_depend_on_the_batch(S, T, nkv, rep, D, window, sinks, extra, seed):
    """Near the float64 attention; each row alone gives its bits in the batch, however many keys past its
    position follow (NaN there: a cache's unwritten rows are never read)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(S, nkv, D, generator=g), torch.randn(S, nkv, D, generator=g)
    q = torch.randn(T, nkv * rep, D, generator=g)
    positions = torch.randint(0, S, (T,), generator=g)
    sink = torch.randn(nkv * rep, generator=g) if sinks else None
    got = attention_cpu(q, keys, values, positions, window, sink)
    assert torch.allclose(got.double(), _naive(q, keys, values, positions, window, sink), rtol=1e-4, atol=1e-5)
    pad = torch.full((extra, nkv, D), float("nan"))
    longer_k, longer_v = torch.cat((keys, pad)), torch.cat((values, pad))
    for t in range(T):
        alone = attention_cpu(q[t:t + 1], longer_k, longer_v, positions[t:t + 1], window, sink)
        assert torch.equal(alone, got[t:t + 1])


def test_the_bodies_and_thread_counts_give_the_same_bits():
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(700, 2, 64, generator=g), torch.randn(700, 2, 64, generator=g)
    q = torch.randn(33, 8, 64, generator=g)
    positions = torch.arange(667, 700)
    want = attention_cpu(q, keys, values, positions)
    best, threads = torch.ops.strata.cpu_kernel_isa(), torch.get_num_threads()
    try:
        for isa in range(best):
            assert torch.ops.strata.cpu_kernel_limit_isa(isa) == isa
            assert torch.equal(attention_cpu(q, keys, values, positions), want)
        torch.ops.strata.cpu_kernel_limit_isa(best)
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(attention_cpu(q, keys, values, positions), want)
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)
        torch.set_num_threads(threads)


def test_opcheck_attention_cpu():
    q, keys, values = torch.randn(3, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    torch.library.opcheck(torch.ops.strata.attention_cpu.default, (q, keys, values, torch.arange(6, 9), 0, None))
    torch.library.opcheck(torch.ops.strata.attention_cpu.default,
                          (q, keys, values, torch.arange(3), 0, None, torch.tensor([8, 0, 4])))


@given(S=st.integers(1, 200), T=st.integers(1, 5), spare=st.integers(0, 50), window=st.sampled_from([None, 7]),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_rows_read_through_row_ids_are_the_gathered_rows_bits(S, T, spare, window, seed):
    """A paged cache's pool read in place (key s at row ``rows[s]``, in any order, among rows no position
    names: NaN, never read) gives the bits of the same keys gathered first."""
    g = torch.Generator().manual_seed(seed)
    N = S + spare
    pool_k, pool_v = torch.full((N, 2, 16), float("nan")), torch.full((N, 2, 16), float("nan"))
    rows = torch.randperm(N, generator=g)[:S]
    pool_k[rows], pool_v[rows] = torch.randn(S, 2, 16, generator=g), torch.randn(S, 2, 16, generator=g)
    q, positions = torch.randn(T, 4, 16, generator=g), torch.randint(0, S, (T,), generator=g)
    want = attention_cpu(q, pool_k[rows], pool_v[rows], positions, window)
    assert torch.equal(attention_cpu(q, pool_k, pool_v, positions, window, rows=rows), want)


def test_a_row_id_outside_the_keys_is_an_error():
    q, keys = torch.randn(2, 2, 16), torch.randn(5, 1, 16)
    with pytest.raises(ValueError, match="a row id outside the 5 rows of keys"):
        attention_cpu(q, keys, keys, torch.arange(2), rows=torch.tensor([0, 5]))
