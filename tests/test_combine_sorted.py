"""``combine_sorted`` (ops/combine.py): a prompt layer's rows, stored in the order the grouped prefill
computes them, combined as ``combine_rows`` combines them in pair order (on CUDA one Triton launch)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops.combine import combine_rows, combine_sorted, in_pair_order


def _case(T: int, k: int, H: int, seed: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(T * k, H, generator=gen).to(dtype)  # [P, H] in pair order
    order = torch.randperm(T * k, generator=gen)  # row i of the sorted buffer is pair order[i]
    weights = torch.rand(T, k, generator=gen)
    return rows.to(device), order.to(device), weights.to(device)


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 9), k=st.integers(1, 8), H=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_rows_go_back_to_pair_order(T, k, H, seed):
    rows, order, _ = _case(T, k, H, seed, torch.float32)
    assert torch.equal(in_pair_order(rows[order], order), rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combined_from_the_sorted_rows_as_from_pair_order_on_the_cpu(dtype):
    rows, order, weights = _case(7, 4, 33, 0, dtype)
    assert torch.equal(combine_sorted(rows[order], order, weights), combine_rows(rows.view(7, 4, 33), weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("T, k, H", [(1, 1, 8), (300, 8, 2048), (5, 10, 4096 + 24)])
def test_the_cuda_kernel_matches_combine_rows(dtype, tol, T, k, H):
    rows, order, weights = _case(T, k, H, 1, dtype, "cuda")
    got = combine_sorted(rows[order], order, weights)
    want = combine_rows(rows.view(T, k, H), weights)
    assert got.dtype == want.dtype and got.shape == (T, H)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
