"""Matrix products whose rows do not depend on the batch: ``matmul`` and ``linear``.

On the CPU, BLAS picks a different algorithm for a one-row product (gemv) than for a many-row one
(gemm), so the same token's logits would change with the batch size or the prompt chunk size.
Padding the row count to a multiple of :data:`ROW_TILE` keeps every product on the gemm path, where
each output row is computed by the same kernel in the same order whatever the other rows are: this
is what makes logits bit-identical across chunk sizes, decode batches and topologies on the CPU
(tests/test_batch_invariance.py checks it). On other devices the products are plain, except while
``invariant_rows`` is on (``--batch-invariant`` decode windows): then their rows are padded to
:data:`INVARIANT_ROWS`, so every window of up to that many rows runs the one cuBLAS kernel of that many
rows, in which a row's result does not depend on the others.

A weight product (``linear``) of float32 on the CPU goes through ``strata::linear_cpu`` instead where the
CPU kernels are loaded: each output one fixed-order dot product, rows invariant by construction, so a
decode row is one pass over the weight rather than a padded 16-row product (four to five times the work).

Elementwise transcendental functions (exp, sigmoid, softplus, SiLU) have the same problem in a
smaller way: the CPU kernel computes whole SIMD vectors with one implementation and the leftover
tail with the scalar one, which may round differently. ``batch_invariant(fn, x)`` applies ``fn`` with
each row padded so every element of a row goes through the vector code, whatever the number of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from strata_core.ops.cpu_kernels import cpu_kernels, linear_cpu

ROW_TILE = 16
#: row width ``batch_invariant`` pads to: a multiple of the widest CPU kernel step (2 AVX-512 vectors of float32)
LANE_TILE = 64
#: the rows a product off the CPU is padded to a multiple of while ``invariant_rows`` is on
INVARIANT_ROWS = 64

_device_tile: ContextVar[int] = ContextVar("strata_device_row_tile", default=0)


@contextmanager
def invariant_rows() -> Iterator[None]:
    """While the block runs, ``matmul`` and ``linear`` off the CPU pad their rows to a multiple of
    :data:`INVARIANT_ROWS`: each row's result is then the same whatever the other rows."""
    token = _device_tile.set(INVARIANT_ROWS)
    try:
        yield
    finally:
        _device_tile.reset(token)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., M, K] @ b [..., K, N]``; on the CPU, and elsewhere under ``invariant_rows``, each row of the
    result is independent of M."""
    tile = ROW_TILE if a.device.type == "cpu" else _device_tile.get()
    rows = a.shape[-2]
    pad = (-rows) % tile if rows and tile else 0
    if pad == 0:
        return a @ b
    return (F.pad(a, (0, 0, 0, pad)) @ b)[..., :rows, :]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., in] @ weight.T -> [..., out]`` with batch-invariant rows on the CPU: float32 through
    ``strata::linear_cpu`` where the CPU kernels are loaded (rows invariant by construction, one row
    not padded to a tile), else ``matmul``."""
    kernel = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and cpu_kernels()
    if kernel and x.dim() == 2:
        return linear_cpu(x, weight)  # [M, out]: rows as they are, no reshapes
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [M, in]
    out = linear_cpu(flat, weight) if kernel else matmul(flat, weight.T)  # [M, out]
    return out.reshape(*lead, weight.shape[0])


def batch_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, batch-invariant on the CPU: each row's result does not depend on
    how many rows ``x`` has (a token's value is the same in a chunk of one or of thousands).

    Why: the CPU kernel runs whole SIMD vectors with one implementation and the leftover tail with the
    scalar one, which may round differently, and where the tail falls depends on the element count. The
    last dim is padded to :data:`LANE_TILE`, so every element of a row goes through the vector code.
    On other devices ``fn(x)`` as it is."""
    if x.device.type != "cpu":
        return fn(x)
    n = x.shape[-1]
    return fn(F.pad(x, (0, (-n) % LANE_TILE)))[..., :n]
