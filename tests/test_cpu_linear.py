"""``strata::linear_cpu``: the CPU's float32 weight product against float64, each row's bits its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops.cpu_kernels import cpu_kernels, linear_cpu

pytestmark = pytest.mark.skipif(not cpu_kernels(), reason="the CPU kernels did not build (see the warning)")


@given(M=st.integers(1, 140), K=st.integers(1, 300), N=st.integers(1, 150), split=st.integers(0, 140),
       threads=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_rows_match_float64_and_do_not_depend_on_the_batch_or_threads(M, K, N, split, threads, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = linear_cpu(x, w)
    finally:
        torch.set_num_threads(before)
    want = x.double() @ w.double().T
    assert torch.allclose(whole.double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
    split = min(split, M)
    assert torch.equal(torch.cat((linear_cpu(x[:split], w), linear_cpu(x[split:], w))), whole)


def test_the_bodies_give_the_same_bits():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 517, generator=g), torch.randn(70, 517, generator=g)
    want = linear_cpu(x, w)
    best = torch.ops.strata.cpu_kernel_isa()
    try:
        for isa in range(best):
            assert torch.ops.strata.cpu_kernel_limit_isa(isa) == isa
            assert torch.equal(linear_cpu(x, w), want)
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)


def test_opcheck_linear_cpu():
    torch.library.opcheck(torch.ops.strata.linear_cpu.default, (torch.randn(3, 20), torch.randn(5, 20)))
