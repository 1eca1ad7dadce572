"""A prompt layer's expert rows combined from the order the grouped prefill computes them in.

The grouped prefill (experts/grouped.py) computes the rows of a layer's (token, k) pairs sorted by
device and expert and stores each group's rows in one slice of a ``[T*k, H]`` buffer: pair
``order[i]``'s row is ``rows[i]``. :func:`combine_sorted` gives the routed output ``[T, H]`` from that
buffer as :func:`combine_rows` gives it from the rows in pair order (each
product rounded to the rows' dtype, the k of a token summed in float32 in k order). On CUDA that is one
Triton launch that reads each row once, where putting the rows back in pair order and combining them
would write and read the buffer twice more; elsewhere it is exactly that (:func:`in_pair_order`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata_core.ops.cpu_kernels import combine_cpu, cpu_kernels
from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["combine_rows", "combine_sorted", "in_pair_order"]


def combine_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed output ``[T, H]`` from ``rows [T, k, H]`` and ``weights [T, k]``, in one fixed order (on the
    CPU in float32 ``strata::combine_cpu``: j ascending, one call, where the CPU kernels are loaded)."""
    if rows.device.type == "cpu" and rows.dtype == weights.dtype == torch.float32 and cpu_kernels():
        return combine_cpu(rows, weights)
    return (rows * weights[..., None].to(rows.dtype)).sum(1)  # [T, H]


def in_pair_order(rows: Tensor, order: Tensor) -> Tensor:
    """``[P, H]``: row p is pair p's, from ``rows`` whose row i is pair ``order[i]``'s (a permutation of P)."""
    return torch.empty_like(rows).index_copy_(0, order, rows)


def combine_sorted(rows: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """The routed output ``[T, H]``: ``sum_j weights[t, j] * row of pair t*k + j``, where ``rows [T*k, H]``
    holds pair ``order[i]``'s row at i and ``weights`` is ``[T, k]``."""
    T, k = weights.shape
    if rows.device.type == "cuda" and HAS_TRITON:
        return _combine_cuda(rows, order, weights)
    return combine_rows(in_pair_order(rows, order).view(T, k, -1), weights)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _combine_kernel(rows, where, weights, out, H, K: tl.constexpr, BLOCK: tl.constexpr):
        """Program (t, b): columns ``[b*BLOCK, (b+1)*BLOCK)`` of token t's output, its K rows read at
        ``where[t*K + j]``, each product rounded to the rows' dtype and summed in float32 in j order."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            i = tl.load(where + t * K + j)
            w = tl.load(weights + t * K + j).to(rows.dtype.element_ty)
            r = tl.load(rows + i * H + cols, mask=mask, other=0.0)
            acc += (r * w).to(rows.dtype.element_ty).to(tl.float32)
        tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=mask)

    def _combine_cuda(rows: Tensor, order: Tensor, weights: Tensor) -> Tensor:
        T, k = weights.shape
        H = rows.shape[1]
        where = torch.empty_like(order)  # [P]: where pair p's row is
        where[order] = torch.arange(order.numel(), device=order.device)
        out = rows.new_empty(T, H)
        block = min(1024, triton.next_power_of_2(H))
        with on_device(rows.device):
            _combine_kernel[(T, triton.cdiv(H, block))](rows.contiguous(), where, weights.contiguous(), out, H,
                                                       K=k, BLOCK=block, num_warps=4)
        return out
