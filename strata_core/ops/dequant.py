"""The Triton dequantizer behind ``strata::dequantize`` on CUDA: GGML blocks -> bf16 / fp16 / fp32.

:func:`dequantize_cuda` decodes every block of ``raw`` with :func:`strata_core.ops.qdecode.decode`
and writes the values in the requested dtype directly (no float32 intermediate). One program
decodes ``BLOCKS`` consecutive blocks laid out as a ``[BLOCKS, block_size]`` tile, so the
per-block scale fields are loaded once per block. ``raw`` may be any contiguous tensor, or a 2-D
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

from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES, block_geometry, table

__all__ = ["dequantize_cuda", "fallback_note"]

log = logging.getLogger(__name__)
_NOTED: set[int] = set()


def fallback_note(qtype: int, what: str) -> None:
    """Log once per (type, kernel) that ``what`` runs the torch reference for ``qtype``."""
    key = hash((int(qtype), what))
    if key not in _NOTED:
        _NOTED.add(key)
        from strata_core.quant.registry import type_name

        log.info("%s: no device kernel for %s, using the torch reference", what, type_name(qtype))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.qdecode import decode

    @triton.jit
    def _dequant_kernel(raw, out, tab, n_blocks, blocks_per_row, row_stride,
                        BS: tl.constexpr, TS: tl.constexpr, QTYPE: tl.constexpr, BLOCKS: tl.constexpr):
        """Program i: blocks ``[i*BLOCKS, (i+1)*BLOCKS)``; block n sits at
        ``raw + (n // blocks_per_row) * row_stride + (n % blocks_per_row) * TS``."""
        blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
        valid = blk < n_blocks
        blk = tl.where(valid, blk, 0)  # masked blocks decode block 0 and are not stored
        start = (blk // blocks_per_row) * row_stride + (blk % blocks_per_row) * TS
        q = tl.arange(0, BS)
        v = decode(raw + start[:, None], q[None, :], tab, QTYPE)  # [BLOCKS, BS]
        offs = blk[:, None] * BS + q[None, :]
        tl.store(out + offs, v.to(out.dtype.element_ty), mask=valid[:, None])

    def dequantize_cuda(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        """``raw`` (uint8 blocks on a CUDA device) -> ``shape`` in ``dtype``; None for a format without
        a kernel. ``raw`` is contiguous, or 2-D with contiguous rows of whole blocks."""
        if int(qtype) not in KERNEL_TYPES:
            return None
        bs, ts = block_geometry(qtype)
        if raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] % ts == 0 and raw.shape[0] > 0:
            blocks_per_row, row_stride = raw.shape[1] // ts, raw.stride(0)
        else:
            raw = raw.contiguous()
            blocks_per_row, row_stride = max(1, raw.numel() // ts), 0
        n_blocks = raw.numel() // ts if raw.is_contiguous() else raw.shape[0] * blocks_per_row
        out = torch.empty(tuple(shape), dtype=dtype, device=raw.device)
        if n_blocks:
            per = 4 if bs == 256 else 32  # 1024 values a program
            _dequant_kernel[(triton.cdiv(n_blocks, per),)](
                raw, out, table(qtype, raw.device), n_blocks, blocks_per_row, row_stride,
                BS=bs, TS=ts, QTYPE=int(qtype), BLOCKS=per, num_warps=4)
        return out
else:
    def dequantize_cuda(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        return None
