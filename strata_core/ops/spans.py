"""Rows of a span whose bounds are on the device: what lets a prompt layer's expert groups be enqueued
before the host knows how many pairs each one has.

A planned prompt layer (experts/grouped.py) cuts its experts into groups from the residency alone; a
group's pairs are then a span ``[start, end)`` of the layer's sorted pairs whose bounds are a cumulative
sum of the routing counts, computed on the device. :func:`gather_span` copies the span's input rows
into a buffer of ``cap`` rows (an upper bound known on the host) and :func:`scatter_span` puts the
group's output rows back at the span, so neither waits for the host to read the counts. On CUDA each
is one Triton launch that moves the span's rows only (the programs past it load and store nothing);
elsewhere the bounds are read and the rows indexed.
"""

from __future__ import annotations

from torch import Tensor

from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["gather_span", "scatter_span"]


def gather_span(src: Tensor, index: Tensor, start: Tensor, end: Tensor, cap: int) -> Tensor:
    """``[cap, H]``: row i is ``src[index[start + i]]`` for ``i < end - start``; the rows past it are
    unspecified. ``start`` and ``end`` are one-element integer tensors on ``src``'s device,
    ``end - start <= cap``."""
    if src.device.type == "cuda" and HAS_TRITON:
        return _gather_cuda(src, index, start, end, cap)
    first, last = int(start), int(end)
    out = src.new_empty(cap, src.shape[1])
    out[:last - first] = src.index_select(0, index[first:last])
    return out


def scatter_span(dst: Tensor, rows: Tensor, start: Tensor, end: Tensor) -> None:
    """``dst[start + i] = rows[i]`` for ``i < end - start`` (bounds as :func:`gather_span` takes them)."""
    if dst.device.type == "cuda" and HAS_TRITON:
        _scatter_cuda(dst, rows, start, end)
        return
    first, last = int(start), int(end)
    dst[first:last] = rows[:last - first]


if HAS_TRITON:
    import triton
    import triton.language as tl

    _ROWS, _COLS = 16, 512

    @triton.jit
    def _gather_kernel(src, index, start, end, out, H, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Program (r, c): rows ``[r*ROWS, (r+1)*ROWS)`` and columns ``[c*COLS, (c+1)*COLS)`` of ``out``."""
        first = tl.load(start).to(tl.int64)
        n = tl.load(end).to(tl.int64) - first
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        live = rows < n
        source = tl.load(index + first + rows, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & (cols[None, :] < H)
        values = tl.load(src + source[:, None] * H + cols[None, :], mask=mask)
        tl.store(out + rows[:, None] * H + cols[None, :], values, mask=mask)

    @triton.jit
    def _scatter_kernel(rows_in, start, end, dst, H, ROWS: tl.constexpr, COLS: tl.constexpr):
        """Program (r, c): rows ``[r*ROWS, (r+1)*ROWS)`` of ``rows_in`` into ``dst`` from ``start``."""
        first = tl.load(start).to(tl.int64)
        n = tl.load(end).to(tl.int64) - first
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        mask = (rows < n)[:, None] & (cols[None, :] < H)
        values = tl.load(rows_in + rows[:, None] * H + cols[None, :], mask=mask)
        tl.store(dst + (first + rows)[:, None] * H + cols[None, :], values, mask=mask)

    def _grid(n_rows: int, H: int) -> tuple[int, int]:
        return triton.cdiv(max(n_rows, 1), _ROWS), triton.cdiv(H, _COLS)

    def _gather_cuda(src: Tensor, index: Tensor, start: Tensor, end: Tensor, cap: int) -> Tensor:
        src = src.contiguous()
        H = src.shape[1]
        out = src.new_empty(cap, H)
        with on_device(src.device):
            _gather_kernel[_grid(cap, H)](src, index, start, end, out, H, ROWS=_ROWS, COLS=_COLS, num_warps=4)
        return out

    def _scatter_cuda(dst: Tensor, rows: Tensor, start: Tensor, end: Tensor) -> None:
        H = dst.shape[1]
        with on_device(dst.device):  # dst: the contiguous buffer of a layer's rows (grouped_rows)
            _scatter_kernel[_grid(rows.shape[0], H)](rows.contiguous(), start, end, dst, H, ROWS=_ROWS, COLS=_COLS,
                                                     num_warps=4)
