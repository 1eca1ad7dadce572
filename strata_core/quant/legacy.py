"""The 32-value legacy formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

``_0`` formats are symmetric (``d * (q - offset)``), ``_1`` formats affine (``d * q + m``), with
fp16 ``d`` and ``m`` at the start of each block.
"""

from __future__ import annotations

import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, fp16_scales
from strata_core.quant.bits import fields, fp16, unpack


def _q4(qs: Tensor) -> Tensor:
    """16 bytes of nibbles -> ``[n, 32]`` float32 codes 0..15 (low nibbles first)."""
    return unpack(qs, 4, 16).float()


def _q5(qh: Tensor, qs: Tensor) -> Tensor:
    """4 bytes of fifth bits + 16 bytes of nibbles -> ``[n, 32]`` float32 codes 0..31."""
    return (unpack(qs, 4, 16) | (unpack(qh, 1, 1) << 4)).float()


def _q4_0(blocks: Tensor) -> Tensor:  # [n, 18] -> [n, 32]
    d, qs = fields(blocks, 2, 16)
    return fp16(d) * (_q4(qs) - 8)


def _q4_1(blocks: Tensor) -> Tensor:  # [n, 20] -> [n, 32]
    d, m, qs = fields(blocks, 2, 2, 16)
    return fp16(d) * _q4(qs) + fp16(m)


def _q5_0(blocks: Tensor) -> Tensor:  # [n, 22] -> [n, 32]
    d, qh, qs = fields(blocks, 2, 4, 16)
    return fp16(d) * (_q5(qh, qs) - 16)


def _q5_1(blocks: Tensor) -> Tensor:  # [n, 24] -> [n, 32]
    d, m, qh, qs = fields(blocks, 2, 2, 4, 16)
    return fp16(d) * _q5(qh, qs) + fp16(m)


def _q8_0(blocks: Tensor) -> Tensor:  # [n, 34] -> [n, 32]
    d, qs = fields(blocks, 2, 32)
    return qs.view(torch.int8).float() * fp16(d)


FORMATS = (
    BlockFormat(T.Q4_0, _q4_0, fp16_scales((0, 8))),
    BlockFormat(T.Q4_1, _q4_1, fp16_scales((0, 15), (2, 1))),
    BlockFormat(T.Q5_0, _q5_0, fp16_scales((0, 16))),
    BlockFormat(T.Q5_1, _q5_1, fp16_scales((0, 31), (2, 1))),
    BlockFormat(T.Q8_0, _q8_0, fp16_scales((0, 127))),
)
