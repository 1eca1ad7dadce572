"""Every supported block format by GGML type, shape checks, and the torch reference dequantizer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from torch import Tensor

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.quant import floats, iquants, kquants, legacy, lut4
from strata_core.quant.base import BlockFormat

FORMATS: Mapping[GGMLQuantizationType, BlockFormat] = MappingProxyType(
    {
        fmt.qtype: fmt
        for family in (floats, legacy, kquants, lut4, iquants)
        for fmt in family.FORMATS
    }
)

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMATS)


def type_name(qtype: int) -> str:
    """``Q4_K`` for a known GGML type id, ``type 99`` otherwise."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {int(qtype)}"


def names(types: frozenset[GGMLQuantizationType]) -> str:
    """Comma-separated type names in GGML id order."""
    return ", ".join(t.name for t in sorted(types))


def get_format(qtype: int, *, name: str = "tensor") -> BlockFormat:
    """The :class:`BlockFormat` of ``qtype``; UnsupportedError naming it and listing the supported ones."""
    fmt = FORMATS.get(qtype) if isinstance(qtype, int) else None
    if fmt is None:
        raise UnsupportedError(
            f"{name}: block format {type_name(qtype)} is not supported; "
            f"supported: {names(SUPPORTED_TYPES)}"
        )
    return fmt


def bytes_for(qtype: int, shape: Sequence[int], *, name: str = "tensor") -> int:
    """Bytes that a tensor of logical ``shape`` (row length last) takes in format ``qtype``."""
    fmt = get_format(qtype, name=name)
    if len(shape) == 0 or any(size < 0 for size in shape):
        raise ModelFileError(f"{name}: invalid shape {tuple(shape)} for {fmt.qtype.name}")
    if shape[-1] % fmt.block_size != 0:
        raise ModelFileError(
            f"{name}: row length {shape[-1]} of shape {tuple(shape)} is not a multiple of the "
            f"{fmt.qtype.name} block size {fmt.block_size}"
        )
    return math.prod(shape) // fmt.block_size * fmt.type_size


def check_shape(
    qtype: int, shape: Sequence[int], nbytes: int | None = None, *, name: str = "tensor"
) -> None:
    """Raise unless ``qtype`` is supported, ``shape`` fits its blocks and (if given) ``nbytes`` matches.

    UnsupportedError for an unknown or unsupported type, ModelFileError for a bad shape or size.
    """
    expected = bytes_for(qtype, shape, name=name)
    if nbytes is not None and nbytes != expected:
        raise ModelFileError(
            f"{name}: {type_name(qtype)} shape {tuple(shape)} needs {expected} bytes, got {nbytes}"
        )


#: Blocks are dequantized in chunks of about this many values on the CPU, so that the dozen
#: intermediate tensors of a format stay in cache (measured faster than one pass over the whole tensor).
CPU_CHUNK_VALUES = 1 << 18


def dequantize_reference(raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """Device-generic torch dequantizer behind ``strata::dequantize`` (no checks beyond the lookup)."""
    fmt = get_format(qtype)
    n_blocks = raw.numel() // fmt.type_size
    blocks = raw.reshape(n_blocks, fmt.type_size)  # [n_blocks, type_size]
    if raw.device.type != "cpu" or n_blocks * fmt.block_size <= CPU_CHUNK_VALUES:
        return fmt.dequantize(blocks).reshape(shape)
    out = torch.empty(n_blocks, fmt.block_size, dtype=torch.float32)  # [n_blocks, block_size]
    step = max(1, CPU_CHUNK_VALUES // fmt.block_size)
    for start in range(0, n_blocks, step):
        out[start : start + step] = fmt.dequantize(blocks[start : start + step])
    return out.reshape(shape)


def random_blocks(
    qtype: int, n_blocks: int, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """``[n_blocks, type_size]`` uint8 of valid random blocks dequantizing to finite values of about ``scale``.

    Codes, grid indices and signs are uniform random bytes; scale fields are finite fp16 (or
    E8M0) values chosen so that the largest representable value is about ``scale``.
    """
    fmt = get_format(qtype)
    size = n_blocks * fmt.type_size
    words = rng.bit_generator.random_raw(-(-size // 8))  # raw 64-bit draws: the fastest random bytes
    blocks = words.view(np.uint8)[:size].reshape(n_blocks, fmt.type_size)
    fmt.fill_scales(blocks, rng, scale)
    return blocks
