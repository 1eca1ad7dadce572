"""The Triton dequantizer behind ``strata::dequantize`` on CUDA: GGML blocks -> bf16 / fp16 / fp32.

:func:`dequantize_cuda` decodes every block of ``raw`` with :func:`strata_core.ops.qdecode.decode`
and writes the values in the requested dtype directly (no float32 intermediate). One program
decodes 1024 values laid out as ``[sub-blocks, SUB]`` (see qdecode), so the scale fields are loaded
once per sub-block. ``raw`` may be any contiguous tensor, or a 2-D
tensor whose rows (a whole number of blocks each) are strided, like the gate/up/down views of
packed experts ``fmt.split(packed)``.

Formats outside :data:`~strata_core.ops.qdecode.KERNEL_TYPES` return None: the caller falls back
to the torch reference (and logs it once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES, block_geometry, on_device, table
from strata_core.quant.registry import type_name

__all__ = ["dequantize_cuda", "fallback_note"]

log = logging.getLogger(__name__)
_NOTED: set[int] = set()


def fallback_note(qtype: int, what: str) -> None:
    """Log once per (type, kernel) that ``what`` runs the torch reference for ``qtype``."""
    key = hash((int(qtype), what))
    if key not in _NOTED:
        _NOTED.add(key)
        log.info("%s: no device kernel for %s, using the torch reference", what, type_name(qtype))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.qdecode import decode

    @triton.jit
    def _dequant_kernel(raw, out, tab, n_subs, blocks_per_row, row_stride, NS: tl.constexpr, SUB: tl.constexpr,
                        TS: tl.constexpr, QTYPE: tl.constexpr, NT: tl.constexpr):
        """Program i: sub-blocks ``[i*NT, (i+1)*NT)`` (NS of SUB values per block); block n sits at
        ``raw + (n // blocks_per_row) * row_stride + (n % blocks_per_row) * TS``."""
        sub = tl.program_id(0).to(tl.int64) * NT + tl.arange(0, NT)  # [NT]
        valid = sub < n_subs
        sub = tl.where(valid, sub, 0)  # masked sub-blocks decode sub-block 0 and are not stored
        blk = sub // NS
        start = (blk // blocks_per_row) * row_stride + (blk % blocks_per_row) * TS
        w = tl.arange(0, SUB)
        v = decode(raw + start[:, None], (sub % NS)[:, None], w[None, :], tab, QTYPE)  # [NT, SUB]
        tl.store(out + sub[:, None] * SUB + w[None, :], v.to(out.dtype.element_ty), mask=valid[:, None])

    def dequantize_cuda(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        """``raw`` (uint8 blocks on a CUDA device) -> ``shape`` in ``dtype``; None for a format without
        a kernel. ``raw`` is contiguous, or 2-D with contiguous rows of whole blocks."""
        if int(qtype) not in KERNEL_TYPES:
            return None
        bs, ts, sub = block_geometry(qtype)
        if raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] % ts == 0 and raw.shape[0] > 0:
            blocks_per_row, row_stride = raw.shape[1] // ts, raw.stride(0)
            n_blocks = raw.shape[0] * blocks_per_row
        else:
            raw = raw.contiguous()
            n_blocks = raw.numel() // ts
            blocks_per_row, row_stride = max(1, n_blocks), 0
        out = torch.empty(tuple(shape), dtype=dtype, device=raw.device)
        if n_blocks:
            nt = 1024 // sub  # 1024 values a program
            with on_device(raw.device):  # Triton launches on the current device
                _dequant_kernel[(triton.cdiv(n_blocks * (bs // sub), nt),)](
                    raw, out, table(qtype, raw.device), n_blocks * (bs // sub), blocks_per_row, row_stride,
                    NS=bs // sub, SUB=sub, TS=ts, QTYPE=int(qtype), NT=nt, num_warps=4)
        return out
else:
    def dequantize_cuda(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        return None
