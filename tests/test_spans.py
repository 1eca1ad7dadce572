"""``gather_span`` / ``scatter_span`` (ops/spans.py): a span of rows whose bounds are on the device, as a
planned prompt layer's expert groups move their inputs and rows (on CUDA one Triton launch each)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops.spans import gather_span, scatter_span


def _case(P: int, T: int, H: int, start: int, end: int, device: str, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(P * 1000 + start)
    src = torch.randn(T, H, generator=gen).to(dtype).to(device)  # [T, H]
    index = torch.randint(0, T, (P,), generator=gen).to(device)  # [P]
    bounds = torch.tensor([start, end], device=device)
    return src, index, bounds


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 60), T=st.integers(1, 9), H=st.integers(1, 20), data=st.data())
def test_a_span_s_rows_are_gathered_and_put_back_where_its_bounds_say(P, T, H, data):
    start = data.draw(st.integers(0, P))
    end = data.draw(st.integers(start, P))
    cap = data.draw(st.integers(end - start, P + 3))
    src, index, bounds = _case(P, T, H, start, end, "cpu")
    rows = gather_span(src, index, bounds[0], bounds[1], cap)
    assert rows.shape == (cap, H)
    assert torch.equal(rows[:end - start], src[index[start:end]])
    dst = torch.zeros(P, H)
    scatter_span(dst, rows, bounds[0], bounds[1])
    assert torch.equal(dst[start:end], src[index[start:end]])
    assert not dst[:start].any() and not dst[end:].any()  # nothing outside the span is written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P, T, H, start, end, cap", [(1, 1, 8, 0, 1, 1), (70000, 8192, 2048, 30000, 61234, 65536),
                                                     (500, 40, 4096 + 24, 17, 17, 100), (64, 8, 7, 0, 64, 64)])
def test_the_cuda_kernels_move_exactly_the_span(dtype, P, T, H, start, end, cap):
    src, index, bounds = _case(P, T, H, start, end, "cuda", dtype)
    rows = gather_span(src, index, bounds[0], bounds[1], cap)
    assert torch.equal(rows[:end - start], src[index[start:end]])
    dst = torch.zeros(P, H, device="cuda", dtype=dtype)
    scatter_span(dst, rows, bounds[0], bounds[1])
    assert torch.equal(dst[start:end], src[index[start:end]])
    assert not dst[:start].any() and not dst[end:].any()
