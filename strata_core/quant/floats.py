"""Unquantized element types: F32, F16, BF16 (a "block" of one value)."""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, ScaleFill
from strata_core.quant.bits import fp16, reinterpret


def _f32(blocks: Tensor) -> Tensor:  # [n, 4] -> [n, 1]
    return reinterpret(blocks, torch.float32).clone()  # a copy: op outputs never alias inputs


def _bf16(blocks: Tensor) -> Tensor:  # [n, 2] -> [n, 1]
    return reinterpret(blocks, torch.bfloat16).float()


def _random_floats(word: type[np.unsignedinteger], mantissa_bits: int, exponent_bits: int) -> ScaleFill:
    """Writer keeping the random sign and mantissa bits and drawing the exponent from the top
    four below ``scale``, so that ``scale / 16 <= |value| < scale`` (integer ops only: fast)."""
    bias = (1 << (exponent_bits - 1)) - 1
    exponent_mask = ((1 << exponent_bits) - 1) << mantissa_bits

    def fill(blocks: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        words = blocks.view(word)  # [n, 1], already random
        top = min(max(bias + math.floor(math.log2(scale)) - 1, 4), 2 * bias)  # biased exponent
        exponent = words >> mantissa_bits  # [n, 1]; in-place steps from here: this runs on GBs
        exponent &= 3
        np.subtract(top, exponent, out=exponent)
        exponent <<= mantissa_bits
        words &= ~word(exponent_mask)
        words |= exponent

    return fill


FORMATS = (
    BlockFormat(T.F32, _f32, _random_floats(np.uint32, 23, 8)),
    BlockFormat(T.F16, fp16, _random_floats(np.uint16, 10, 5)),
    BlockFormat(T.BF16, _bf16, _random_floats(np.uint16, 7, 8)),
)
