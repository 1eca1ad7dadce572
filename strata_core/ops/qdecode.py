"""Per-type GGML block decoding as Triton device functions, shared by every kernel that reads blocks.

``decode(b, j, w, tab, QTYPE)`` returns the float32 value of element ``q = j * SUB + w`` of the block
starting at byte pointer ``b``, where ``SUB = SUB_SIZE[qtype]`` is the format's scale granularity
(a sub-block: 16 or 32 values sharing a scale) and ``j`` the sub-block. ``b``, ``j`` and ``w`` are
broadcastable tensors: callers lay a tile out as ``[..., sub-blocks, SUB]`` with ``b`` and ``j`` of
shape ``[..., sub-blocks, 1]`` and ``w`` of shape ``[1, ..., SUB]``; each decoder computes its scales
from ``b`` and ``j`` alone, so they are loaded and computed once per sub-block, and only the codes
at full shape (one byte load and a few integer ops a value). ``tab`` is the format's lookup table (:func:`table`): the 16
code values of IQ4_NL / IQ4_XS / MXFP4 (float32) or the lattice grid of IQ3_XXS / IQ3_S (int32,
four int8 values packed per entry); other formats ignore it.

The formulas follow the torch reference (strata_core/quant/*.py, itself bit-identical to gguf-py)
step by step in float32; the only difference allowed by the tolerance is the compiler contracting a
multiply and an add into one fused multiply-add (a relative difference of about 1e-7).

Users: :mod:`strata_core.ops.dequant` (blocks -> bf16/fp16/fp32) and :mod:`strata_core.ops.moe`
(the fused decode MoE kernels, which dot the decoded values with the activations in registers).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch: the references are the only kernels
    triton = None

__all__ = ["HAS_TRITON", "KERNEL_TYPES", "SUB_SIZE", "block_geometry", "on_device", "table"]

HAS_TRITON = triton is not None

#: The block formats the device kernels decode; the others fall back to the torch reference.
KERNEL_TYPES: frozenset[T] = frozenset({
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ3_XXS, T.IQ3_S,
})


#: Values per sub-block (sharing one scale) of each kernel format: the ``SUB`` of ``decode``.
SUB_SIZE: dict[T, int] = {
    T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.IQ4_NL: 32, T.MXFP4: 32,
    T.Q2_K: 16, T.Q3_K: 16, T.Q6_K: 16, T.Q4_K: 32, T.Q5_K: 32, T.IQ4_XS: 32, T.IQ3_XXS: 32, T.IQ3_S: 32,
}


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a Triton launch (Triton launches on the current CUDA device, not the
    tensors'); a no-op off CUDA (the Triton interpreter runs CPU tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def block_geometry(qtype: int) -> tuple[int, int, int]:
    """``(block_size, type_size, sub_size)``: values and bytes of one block of ``qtype``, values of a sub-block."""
    bs, ts = GGML_QUANT_SIZES[T(qtype)]
    return bs, ts, SUB_SIZE.get(T(qtype), bs)


@functools.cache
def table(qtype: int, device: torch.device) -> torch.Tensor:
    """The lookup table ``decode`` reads for ``qtype`` on ``device`` (a 1-element dummy for formats
    without one)."""
    qtype = T(qtype)
    if qtype in (T.IQ4_NL, T.IQ4_XS):
        values = np.asarray(quants.IQ4_NL.kvalues, dtype=np.float32)
    elif qtype == T.MXFP4:
        values = np.asarray(quants.MXFP4.kvalues, dtype=np.float32)
    elif qtype in (T.IQ3_XXS, T.IQ3_S):
        owner = quants.IQ3_XXS if qtype == T.IQ3_XXS else quants.IQ3_S
        owner.init_grid()
        rows = np.ascontiguousarray(owner.grid.reshape(owner.grid_shape), dtype=np.int8)  # [N, 4]
        values = rows.view(np.int32).reshape(-1)  # [N]: 4 int8 grid values, the first in the low byte
    else:
        values = np.zeros(1, dtype=np.float32)
    return torch.from_numpy(values.copy()).to(device)


if HAS_TRITON:
    @triton.jit
    def _u8(p):
        """The byte at ``p`` as int32."""
        return tl.load(p).to(tl.int32)

    @triton.jit
    def _f16(p):
        """The little-endian fp16 at ``p`` as float32."""
        bits = tl.load(p).to(tl.uint16) | (tl.load(p + 1).to(tl.uint16) << 8)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _u32(p):
        """The little-endian uint32 at ``p``."""
        return (tl.load(p).to(tl.uint32) | (tl.load(p + 1).to(tl.uint32) << 8)
                | (tl.load(p + 2).to(tl.uint32) << 16) | (tl.load(p + 3).to(tl.uint32) << 24))

    @triton.jit
    def _nib32(qs, w):
        """Code ``w`` of a 32-value block's 16 bytes of nibbles (low nibbles first)."""
        return (_u8(qs + w % 16) >> ((w // 16) * 4)) & 15

    @triton.jit
    def _crumb16(qs, j, w):
        """2-bit code ``16 j + w`` of a super-block's 64 bytes (runs of 32 bytes, 4 shifts of 32 codes)."""
        return (_u8(qs + (j // 8) * 32 + (j % 2) * 16 + w) >> (((j % 8) // 2) * 2)) & 3

    @triton.jit
    def _q4_k_scale_min(s, j):
        """6-bit scale and min of sub-block ``j`` from the 12 packed bytes at ``s`` (Q4_K / Q5_K)."""
        x0 = _u8(s + j)
        x1 = _u8(s + j + 4)
        x2 = _u8(s + j % 4)
        low = j < 4
        sc = tl.where(low, x0 & 63, (x1 & 15) | ((x2 >> 6) << 4))
        mn = tl.where(low, x1 & 63, (x1 >> 4) | ((x0 >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _ksign(aux, w):
        """+1 / -1 for element ``w`` of a 32-value sub-block whose uint32 ``aux`` holds four 7-bit
        ``ksigns`` indices (bit 7 of a ksigns entry is the parity of the other seven)."""
        idx = ((aux >> ((w // 8) * 7)) & 127).to(tl.int32)
        parity = idx ^ (idx >> 4)
        parity = parity ^ (parity >> 2)
        parity = (parity ^ (parity >> 1)) & 1
        signs = idx | (parity << 7)
        return 1 - 2 * ((signs >> (w % 8)) & 1)

    @triton.jit
    def decode(b, j, w, tab, QTYPE: tl.constexpr):
        """Float32 value of element ``j * SUB + w`` of the ``QTYPE`` block at byte pointer ``b`` (module doc).

        Everything computed from ``b`` and ``j`` alone is per sub-block; only terms in ``w`` are per value.
        """
        if QTYPE == 2:  # Q4_0: d, 16 bytes of nibbles
            v = _f16(b) * (_nib32(b + 2, w) - 8).to(tl.float32)
        elif QTYPE == 3:  # Q4_1: d, m, nibbles
            v = _f16(b) * _nib32(b + 4, w).to(tl.float32) + _f16(b + 2)
        elif QTYPE == 6:  # Q5_0: d, 4 bytes of fifth bits, nibbles
            code = _nib32(b + 6, w) | (((_u8(b + 2 + w // 8) >> (w % 8)) & 1) << 4)
            v = _f16(b) * (code - 16).to(tl.float32)
        elif QTYPE == 7:  # Q5_1: d, m, fifth bits, nibbles
            code = _nib32(b + 8, w) | (((_u8(b + 4 + w // 8) >> (w % 8)) & 1) << 4)
            v = _f16(b) * code.to(tl.float32) + _f16(b + 2)
        elif QTYPE == 8:  # Q8_0: d, 32 int8
            v = tl.load(b + 2 + w).to(tl.int8, bitcast=True).to(tl.float32) * _f16(b)
        elif QTYPE == 10:  # Q2_K: 16 scale bytes, 64 bytes of 2-bit codes, d, dmin; sub-blocks of 16
            s = _u8(b + j)
            dl = _f16(b + 80) * (s & 15).to(tl.float32)
            ml = _f16(b + 82) * (s >> 4).to(tl.float32)
            v = dl * _crumb16(b + 16, j, w).to(tl.float32) - ml
        elif QTYPE == 11:  # Q3_K: hmask, 2-bit codes, 12 bytes of 6-bit scales, d; sub-blocks of 16
            sc = ((_u8(b + 96 + j % 8) >> ((j // 8) * 4)) & 15) | (((_u8(b + 104 + j % 4) >> ((j // 4) * 2)) & 3) << 4)
            dl = _f16(b + 108) * (sc.to(tl.float32) - 32)
            high = (_u8(b + (j % 2) * 16 + w) >> (j // 2)) & 1
            v = dl * (_crumb16(b + 32, j, w).to(tl.float32) - ((high ^ 1) << 2).to(tl.float32))
        elif QTYPE == 12:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles; sub-blocks of 32
            sc, mn = _q4_k_scale_min(b + 4, j)
            code = (_u8(b + 16 + (j // 2) * 32 + w) >> ((j % 2) * 4)) & 15
            v = (_f16(b) * sc) * code.to(tl.float32) - _f16(b + 2) * mn
        elif QTYPE == 13:  # Q5_K: d, dmin, scales, 32 bytes of fifth bits, nibbles; sub-blocks of 32
            sc, mn = _q4_k_scale_min(b + 4, j)
            code = ((_u8(b + 48 + (j // 2) * 32 + w) >> ((j % 2) * 4)) & 15) | (((_u8(b + 16 + w) >> j) & 1) << 4)
            v = (_f16(b) * sc) * code.to(tl.float32) - _f16(b + 2) * mn
        elif QTYPE == 14:  # Q6_K: 128 bytes low nibbles, 64 bytes high crumbs, 16 int8 scales, d; sub-blocks of 16
            low = (_u8(b + (j // 8) * 64 + (j % 4) * 16 + w) >> (((j % 8) // 4) * 4)) & 15
            high = _crumb16(b + 128, j, w)
            sc = tl.load(b + 192 + j).to(tl.int8, bitcast=True).to(tl.float32)
            v = (_f16(b + 208) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
        elif QTYPE == 20:  # IQ4_NL: d, nibbles looked up in 16 values
            v = _f16(b) * tl.load(tab + _nib32(b + 2, w))
        elif QTYPE == 23:  # IQ4_XS: d, 2 bytes high scale bits, 4 bytes low scale nibbles, nibbles
            sc = ((_u8(b + 4 + j // 2) >> ((j % 2) * 4)) & 15) | (((_u8(b + 2 + j // 4) >> ((j % 4) * 2)) & 3) << 4)
            dl = _f16(b) * (sc.to(tl.float32) - 32)
            v = dl * tl.load(tab + _nib32(b + 8 + j * 16, w))
        elif QTYPE == 39:  # MXFP4: E8M0 exponent, nibbles looked up in 16 (doubled e2m1) values
            e = _u8(b)
            bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
            v = bits.to(tl.float32, bitcast=True) * tl.load(tab + _nib32(b + 1, w))
        elif QTYPE == 18:  # IQ3_XXS: d, 64 grid indices, 8 uint32 (4 ksigns indices + 4-bit scale)
            aux = _u32(b + 66 + j * 4)
            db = (_f16(b) * (0.5 + (aux >> 28).to(tl.float32))) * 0.5
            grid = (tl.load(tab + _u8(b + 2 + j * 8 + w // 4)) >> ((w % 4) * 8)) & 255
            v = db * (grid * _ksign(aux, w)).to(tl.float32)
        elif QTYPE == 21:  # IQ3_S: d, 64 low index bytes, 8 bytes of 9th bits, 32 sign bytes, 4 scale bytes
            index = _u8(b + 2 + j * 8 + w // 4) | (((_u8(b + 66 + j) >> (w // 4)) & 1) << 8)
            grid = (tl.load(tab + index) >> ((w % 4) * 8)) & 255
            sign = 1 - 2 * ((_u8(b + 74 + j * 4 + w // 8) >> (w % 8)) & 1)
            db = _f16(b) * (1 + 2 * ((_u8(b + 106 + j // 2) >> ((j % 2) * 4)) & 15)).to(tl.float32)
            v = db * (grid * sign).to(tl.float32)
        else:
            tl.static_assert(False, "no device decoder for this block format")
        return v
else:
    decode = None
