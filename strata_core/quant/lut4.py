"""4-bit codes looked up in a 16-entry value table: IQ4_NL, IQ4_XS (non-linear) and MXFP4 (e2m1)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.quant.base import BlockFormat, fp16_scales
from strata_core.quant.bits import fields, fp16, grouped, lookup, unpack


@functools.cache
def _values(qtype: T, device: torch.device) -> Tensor:
    """The format's 16 code values (gguf-py's ``kvalues``) as ``[16]`` float32 on ``device``."""
    kvalues = {T.IQ4_NL: quants.IQ4_NL.kvalues, T.MXFP4: quants.MXFP4.kvalues}[qtype]
    return torch.tensor(kvalues, dtype=torch.float32, device=device)


def _codes(qtype: T, qs: Tensor) -> Tensor:
    """Nibbles in runs of 16 bytes (low nibbles first) -> ``[n, 2 * bytes]`` float32 code values."""
    return lookup(_values(qtype, qs.device), unpack(qs, 4, 16))


def _iq4_nl(blocks: Tensor) -> Tensor:  # [n, 18] -> [n, 32]
    d, qs = fields(blocks, 2, 16)
    return fp16(d) * _codes(T.IQ4_NL, qs)


def _iq4_xs(blocks: Tensor) -> Tensor:  # [n, 136] -> [n, 256]
    d, scales_h, scales_l, qs = fields(blocks, 2, 2, 4, 128)
    sc = unpack(scales_l, 4, 1) | (unpack(scales_h, 2, 1) << 4)  # [n, 8] 6-bit
    dl = fp16(d) * (sc.float() - 32)  # [n, 8]
    return grouped(dl, _codes(T.IQ4_NL, qs))


def _e8m0_half(e: Tensor) -> Tensor:
    """``[n, 1]`` uint8 E8M0 exponents -> float32 ``2**(e - 128)`` (ggml_e8m0_to_fp32_half)."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)  # [n, 1] float32 bit patterns
    return bits.view(torch.float32)


def _mxfp4(blocks: Tensor) -> Tensor:  # [n, 17] -> [n, 32]
    e, qs = fields(blocks, 1, 16)
    return _e8m0_half(e) * _codes(T.MXFP4, qs)


def _mxfp4_scales(blocks: np.ndarray, rng: np.random.Generator, scale: float) -> None:
    """E8M0 exponent near ``scale / 12`` (12 is the largest doubled e2m1 value)."""
    centre = 128 + int(np.floor(np.log2(scale / 12)))
    blocks[:, 0] = np.clip(centre - rng.integers(0, 2, blocks.shape[0]), 2, 254)


FORMATS = (
    BlockFormat(T.IQ4_NL, _iq4_nl, fp16_scales((0, 127))),
    BlockFormat(T.IQ4_XS, _iq4_xs, fp16_scales((0, 32 * 127))),
    BlockFormat(T.MXFP4, _mxfp4, _mxfp4_scales),
)
