"""Unquantized element types: F32, F16, BF16 (a "block" of one value)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, ScaleFill
from strata_core.quant.bits import fp16


def _f32(blocks: Tensor) -> Tensor:  # [n, 4] -> [n, 1]
    return blocks.contiguous().view(torch.float32).clone()  # a copy: op outputs never alias inputs


def _bf16(blocks: Tensor) -> Tensor:  # [n, 2] -> [n, 1]
    return blocks.contiguous().view(torch.bfloat16).float()


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (truncation; finite stays finite)."""
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def _normal_values(encode: Callable[[np.ndarray], np.ndarray]) -> ScaleFill:
    """Writer replacing every value by ``scale * N(0, 1)``, stored through ``encode``."""

    def fill(blocks: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        values = rng.standard_normal(blocks.shape[0], dtype=np.float32) * np.float32(scale)  # [n]
        blocks[:] = encode(values).view(np.uint8).reshape(blocks.shape)

    return fill


FORMATS = (
    BlockFormat(T.F32, _f32, _normal_values(lambda v: v)),
    BlockFormat(T.F16, fp16, _normal_values(lambda v: v.astype(np.float16))),
    BlockFormat(T.BF16, _bf16, _normal_values(_bf16_bits)),
)
