"""Lattice ("grid") i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Each group of 8 (IQ2, IQ1) or 4 (IQ3) values is one row of a fixed grid, picked by an index, with
signs either from ``ksigns`` (7 stored bits + parity) or stored bit by bit. The grids and
``ksigns`` come from gguf-py's tables, converted once per device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, fp16_scales, random_scales
from strata_core.quant.bits import (
    fields,
    fp16,
    fp16_from_bits,
    grouped,
    le_uint,
    lookup_rows,
    packed_rows,
    shift_fields,
    unpack,
)

#: The gguf-py class whose grid each format uses (IQ1_M shares IQ1_S's grid).
_GRID_OWNER = {
    T.IQ2_XXS: quants.IQ2_XXS,
    T.IQ2_XS: quants.IQ2_XS,
    T.IQ2_S: quants.IQ2_S,
    T.IQ3_XXS: quants.IQ3_XXS,
    T.IQ3_S: quants.IQ3_S,
    T.IQ1_S: quants.IQ1_S,
    T.IQ1_M: quants.IQ1_S,
}

_IQ1_DELTA = float(quants.IQ1_S.delta)
#: Largest |value| / |d| of IQ1_S and IQ1_M: sub-block scale 2*7+1 times grid value 1 + delta.
_IQ1_SPAN = 15 * (1 + _IQ1_DELTA)


@functools.cache
def _grid(qtype: T, device: torch.device) -> Tensor:
    """The grid of ``qtype`` as packed int8 rows of 8 (IQ2, IQ1) or 4 (IQ3) values."""
    owner = _GRID_OWNER[qtype]
    owner.init_grid()
    return packed_rows(owner.grid.reshape(owner.grid_shape), device)


def _sign_rows(sign_bits: np.ndarray) -> np.ndarray:
    """``[N]`` bytes -> ``[N, 8]`` int8: +1 where a bit is clear, -1 where set, low bit first."""
    bits = np.unpackbits(sign_bits[:, None], axis=1, bitorder="little")  # [N, 8]
    return np.where(bits == 0, 1, -1)


@functools.cache
def _ksigns(device: torch.device) -> Tensor:
    """The 8 signs each 7-bit ``ksigns`` index stands for, as packed int8 rows."""
    return packed_rows(_sign_rows(np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)), device)


@functools.cache
def _byte_signs(device: torch.device) -> Tensor:
    """The 8 signs a byte of stored sign bits stands for, as packed int8 rows."""
    return packed_rows(_sign_rows(np.arange(256, dtype=np.uint8)), device)


def _rows(qtype: T, index: Tensor) -> Tensor:
    """Grid indices ``[n, k]`` -> ``[n, k * row_width]`` int8 grid values."""
    return lookup_rows(_grid(qtype, index.device), index).flatten(1)


def _packed_signs(words: Tensor) -> Tensor:
    """``[n, k]`` 32-bit words with four 7-bit ``ksigns`` indices -> ``[n, 32 k]`` int8 +-1."""
    index = shift_fields(words, (0, 7, 14, 21), 0x7F)  # [n, 4 k]
    return lookup_rows(_ksigns(words.device), index).flatten(1)


def _stored_signs(sign_bytes: Tensor) -> Tensor:
    """``[n, m]`` bytes of sign bits -> ``[n, 8 m]`` int8 +-1."""
    return lookup_rows(_byte_signs(sign_bytes.device), sign_bytes).flatten(1)


def _signed(grid: Tensor, signs: Tensor) -> Tensor:
    """int8 grid values times int8 signs, as float32.

    gguf-py computes ``(scale * grid) * sign``; a sign flip is exact, so ``scale * (grid * sign)``
    is bit-identical and needs one float pass less.
    """
    return (grid * signs).float()


def _half_step_scale(d: Tensor, codes: Tensor, factor: float) -> Tensor:
    """IQ2 / IQ3_XXS sub-block scale ``d * (0.5 + code) * factor`` (gguf-py's order)."""
    return fp16(d) * (0.5 + codes.float()) * factor


def _iq2_xxs(blocks: Tensor) -> Tensor:  # [n, 66] -> [n, 256]
    n = blocks.shape[0]
    d, qs = fields(blocks, 2, 64)
    qs = qs.reshape(n, 8, 8)  # [n, 8 sub-blocks, 4 grid indices + 4 bytes of signs and scale]
    aux = le_uint(qs[:, :, 4:].reshape(n, 32), 4)  # [n, 8]
    db = _half_step_scale(d, aux >> 28, 0.25)  # [n, 8]
    grid = _rows(T.IQ2_XXS, qs[:, :, :4].reshape(n, 32))  # [n, 256]
    return grouped(db, _signed(grid, _packed_signs(aux)))


def _iq2_xs(blocks: Tensor) -> Tensor:  # [n, 74] -> [n, 256]
    d, qs, scales = fields(blocks, 2, 64, 8)
    qs = le_uint(qs, 2)  # [n, 32]: 9-bit grid index, 7-bit ksigns index
    db = _half_step_scale(d, unpack(scales, 4, 1), 0.25)  # [n, 16]
    signs = lookup_rows(_ksigns(qs.device), qs >> 9).flatten(1)  # [n, 256]
    return grouped(db, _signed(_rows(T.IQ2_XS, qs & 511), signs))


def _iq2_s(blocks: Tensor) -> Tensor:  # [n, 82] -> [n, 256]
    d, qs, signs, qh, scales = fields(blocks, 2, 32, 32, 8, 8)
    index = qs.long() | (unpack(qh, 2, 1).long() << 8)  # [n, 32] 10-bit
    db = _half_step_scale(d, unpack(scales, 4, 1), 0.25)  # [n, 16]
    return grouped(db, _signed(_rows(T.IQ2_S, index), _stored_signs(signs)))


def _iq3_xxs(blocks: Tensor) -> Tensor:  # [n, 98] -> [n, 256]
    d, qs, aux = fields(blocks, 2, 64, 32)
    aux = le_uint(aux, 4)  # [n, 8]: four 7-bit ksigns indices, 4-bit scale
    db = _half_step_scale(d, aux >> 28, 0.5)  # [n, 8]
    return grouped(db, _signed(_rows(T.IQ3_XXS, qs), _packed_signs(aux)))


def _iq3_s(blocks: Tensor) -> Tensor:  # [n, 110] -> [n, 256]
    d, qs, qh, signs, scales = fields(blocks, 2, 64, 8, 32, 4)
    index = qs.long() | (unpack(qh, 1, 1).long() << 8)  # [n, 64] 9-bit
    db = fp16(d) * (1 + 2 * unpack(scales, 4, 1)).float()  # [n, 8]
    return grouped(db, _signed(_rows(T.IQ3_S, index), _stored_signs(signs)))


def _iq1(qtype: T, dl: Tensor, index: Tensor, negative_delta: Tensor) -> Tensor:
    """IQ1: ``dl * (grid row + delta)``, one +-delta per 8-value row; ``dl`` per run of rows."""
    delta = torch.where(negative_delta, -_IQ1_DELTA, _IQ1_DELTA)  # [n, rows]
    rows = lookup_rows(_grid(qtype, index.device), index).float() + delta.unsqueeze(-1)  # [n, rows, 8]
    return grouped(dl, rows.flatten(1))


def _iq1_s(blocks: Tensor) -> Tensor:  # [n, 50] -> [n, 256]
    d, qs, qh = fields(blocks, 2, 32, 16)
    qh = le_uint(qh, 2)  # [n, 8]: 4 x 3 high index bits, 3-bit scale, delta sign
    dl = fp16(d) * (2 * ((qh >> 12) & 7) + 1).float()  # [n, 8]
    index = qs.long() | (shift_fields(qh, (0, 3, 6, 9), 7) << 8)  # [n, 32] 11-bit
    negative = ((qh & 0x8000) != 0).repeat_interleave(4, dim=1)  # [n, 32]
    return _iq1(T.IQ1_S, dl, index, negative)


def _iq1_m(blocks: Tensor) -> Tensor:  # [n, 56] -> [n, 256]
    qs, qh, scales = fields(blocks, 32, 16, 8)
    scales = le_uint(scales, 2)  # [n, 4]: 4 x 3-bit scales, one nibble of d
    d_bits = ((scales >> 12) << torch.arange(0, 16, 4, device=scales.device)).sum(-1)  # [n]
    d = fp16_from_bits(d_bits).unsqueeze(-1)  # [n, 1]
    dl = d * (2 * shift_fields(scales, (0, 3, 6, 9), 7) + 1).float()  # [n, 16]
    qh = unpack(qh, 4, 1)  # [n, 32]: 3 high index bits, delta sign
    index = qs.long() | ((qh & 7).long() << 8)  # [n, 32] 11-bit
    return _iq1(T.IQ1_M, dl, index, (qh & 8) != 0)


def _iq1_m_scales(blocks: np.ndarray, rng: np.random.Generator, scale: float) -> None:
    """IQ1_M keeps its fp16 ``d`` as the top nibbles of the four 16-bit scale words (bytes 48-55)."""
    n = blocks.shape[0]
    d = random_scales(rng, n, scale / _IQ1_SPAN).astype(np.float16).view(np.uint16)  # [n]
    nibbles = (d[:, None] >> np.arange(0, 16, 4, dtype=np.uint16)) & 0xF  # [n, 4]
    words = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
    words = (words & 0x0FFF) | (nibbles << 12).astype(np.uint16)
    blocks[:, 48:56] = words.view(np.uint8)


# Spans: largest sub-block scale factor times largest grid value (see fp16_scales).
FORMATS = (
    BlockFormat(T.IQ2_XXS, _iq2_xxs, fp16_scales((0, 3.875 * 43))),
    BlockFormat(T.IQ2_XS, _iq2_xs, fp16_scales((0, 3.875 * 43))),
    BlockFormat(T.IQ2_S, _iq2_s, fp16_scales((0, 3.875 * 43))),
    BlockFormat(T.IQ3_XXS, _iq3_xxs, fp16_scales((0, 7.75 * 62))),
    BlockFormat(T.IQ3_S, _iq3_s, fp16_scales((0, 31 * 15))),
    BlockFormat(T.IQ1_S, _iq1_s, fp16_scales((0, _IQ1_SPAN))),
    BlockFormat(T.IQ1_M, _iq1_m, _iq1_m_scales),
)
