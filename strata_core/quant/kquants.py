"""K-quants: 256-value super-blocks with per-sub-block scales (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)."""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, fp16_scales
from strata_core.quant.bits import fields, fp16, grouped, grouped_affine, unpack


def _scale_min_6bit(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 scale bytes of Q4_K / Q5_K -> ``([n, 8], [n, 8])`` float32 6-bit scales and mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low nibbles
    of scales 4-7 and mins 4-7 (high nibble), whose top 2 bits sit in bits 6-7 of bytes 0-7.
    """
    n = packed.shape[0]
    sc, mn, lo = packed.reshape(n, 3, 4).unbind(1)  # 3 x [n, 4]
    scales = torch.cat([sc & 0x3F, (lo & 0x0F) | ((sc >> 2) & 0x30)], dim=-1)  # [n, 8]
    mins = torch.cat([mn & 0x3F, (lo >> 4) | ((mn >> 2) & 0x30)], dim=-1)  # [n, 8]
    return scales.float(), mins.float()


def _q2_k(blocks: Tensor) -> Tensor:  # [n, 84] -> [n, 256]
    scales, qs, d, dmin = fields(blocks, 16, 64, 2, 2)
    dl = fp16(d) * (scales & 0x0F).float()  # [n, 16]
    ml = fp16(dmin) * (scales >> 4).float()  # [n, 16]
    return grouped_affine(dl, ml, unpack(qs, 2, 32).float())


def _q3_k(blocks: Tensor) -> Tensor:  # [n, 110] -> [n, 256]
    hmask, qs, scales, d = fields(blocks, 32, 64, 12, 2)
    low, high = scales[:, :8], scales[:, 8:]
    sc = unpack(low, 4, 8) | (unpack(high, 2, 4) << 4)  # [n, 16] 6-bit
    dl = fp16(d) * (sc.float() - 32)  # [n, 16]
    missing_high = (unpack(hmask, 1, 32) ^ 1) << 2  # [n, 256]: 4 where the high bit is clear
    q = unpack(qs, 2, 32).float() - missing_high.float()  # [n, 256] in -4..3
    return grouped(dl, q)


def _k_affine(d: Tensor, dmin: Tensor, packed_scales: Tensor, q: Tensor) -> Tensor:
    """Q4_K / Q5_K: ``d * sc * q - dmin * m`` over 8 sub-blocks of 32."""
    sc, mn = _scale_min_6bit(packed_scales)
    return grouped_affine(fp16(d) * sc, fp16(dmin) * mn, q.float())


def _q4_k(blocks: Tensor) -> Tensor:  # [n, 144] -> [n, 256]
    d, dmin, scales, qs = fields(blocks, 2, 2, 12, 128)
    return _k_affine(d, dmin, scales, unpack(qs, 4, 32))


def _q5_k(blocks: Tensor) -> Tensor:  # [n, 176] -> [n, 256]
    d, dmin, scales, qh, qs = fields(blocks, 2, 2, 12, 32, 128)
    return _k_affine(d, dmin, scales, unpack(qs, 4, 32) | (unpack(qh, 1, 32) << 4))


def _q6_k(blocks: Tensor) -> Tensor:  # [n, 210] -> [n, 256]
    ql, qh, scales, d = fields(blocks, 128, 64, 16, 2)
    q = (unpack(ql, 4, 64) | (unpack(qh, 2, 32) << 4)).float() - 32  # [n, 256] in -32..31
    dl = fp16(d) * scales.view(torch.int8).float()  # [n, 16]
    return grouped(dl, q)


FORMATS = (
    BlockFormat(T.Q2_K, _q2_k, fp16_scales((80, 15 * 3), (82, 15))),
    BlockFormat(T.Q3_K, _q3_k, fp16_scales((108, 32 * 4))),
    BlockFormat(T.Q4_K, _q4_k, fp16_scales((0, 63 * 15), (2, 63))),
    BlockFormat(T.Q5_K, _q5_k, fp16_scales((0, 63 * 31), (2, 63))),
    BlockFormat(T.Q6_K, _q6_k, fp16_scales((208, 128 * 32))),
)
