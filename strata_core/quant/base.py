"""What a block format is: its byte layout, its dequantizer and how to make valid random blocks.

A format module (floats, legacy, kquants, lut4, iquants) declares one :class:`BlockFormat` per
GGML type; :mod:`strata_core.quant.registry` collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

#: Dequantizer: ``[n_blocks, type_size]`` uint8 -> ``[n_blocks, block_size]`` float32, plain torch.
Dequant = Callable[[Tensor], Tensor]
#: Scale writer: overwrites the scale fields of random ``[n_blocks, type_size]`` uint8 blocks in
#: place so that every block dequantizes to finite values of magnitude about ``scale``.
ScaleFill = Callable[[np.ndarray, np.random.Generator, float], None]


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block format: ``block_size`` values stored in ``type_size`` bytes."""

    qtype: GGMLQuantizationType
    dequantize: Dequant
    fill_scales: ScaleFill

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


def random_scales(rng: np.random.Generator, n: int, magnitude: float) -> np.ndarray:
    """``[n]`` float32 of random sign and absolute value uniform in ``[magnitude / 2, magnitude]``."""
    u = rng.random(n, dtype=np.float32) - np.float32(0.5)  # [n] in [-0.5, 0.5)
    return (u + np.copysign(np.float32(0.5), u)) * np.float32(magnitude)


def fp16_scales(*spans: tuple[int, float]) -> ScaleFill:
    """Scale writer for plain fp16 scale fields, given as ``(byte offset, span)`` pairs.

    ``span`` is the largest ``|value| / |field|`` the format's codes can produce, so a field of
    about ``scale / span`` keeps the dequantized values at about ``scale``.
    """

    def fill(blocks: np.ndarray, rng: np.random.Generator, scale: float) -> None:
        n = blocks.shape[0]
        for offset, span in spans:
            d = random_scales(rng, n, scale / span).astype(np.float16)  # [n]
            blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(n, 2)

    return fill
