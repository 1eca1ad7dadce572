"""GGML block formats: dequantize and quantized matmul through the ``strata::`` custom ops.

Raw blocks are uint8 tensors laid out exactly as in a GGUF file (row-major blocks); shapes are
logical torch shapes, outermost first, row length last. Results match gguf-py's numpy
dequantizers bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from gguf import quants as _gguf_quants
from gguf.constants import GGMLQuantizationType
from torch import Tensor

import strata_core.ops  # noqa: F401  (registers strata::dequantize and strata::quant_matmul)
from strata_core.errors import UnsupportedError
from strata_core.quant.registry import (
    SUPPORTED_TYPES,
    bytes_for,
    check_shape,
    get_format,
    names,
    random_blocks,
)

__all__ = [
    "QUANTIZABLE_TYPES",
    "SUPPORTED_TYPES",
    "bytes_for",
    "check_shape",
    "dequantize",
    "quant_matmul",
    "quantize",
    "random_blocks",
]

_T = GGMLQuantizationType

#: Types :func:`quantize` can write (those gguf-py quantizes, among the supported ones).
QUANTIZABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.MXFP4}
)


def _raw_bytes(raw: Tensor) -> None:
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw blocks must be a uint8 tensor, got {raw.dtype}")


def dequantize(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    """Dequantize uint8 GGML blocks ``raw`` (any shape) to a tensor of ``shape`` in ``dtype``
    (float32 when None; on CUDA other dtypes are written directly, without a float32 copy)."""
    _raw_bytes(raw)
    check_shape(qtype, shape, raw.numel())
    if dtype is None:
        return torch.ops.strata.dequantize(raw, int(qtype), list(shape))
    return torch.ops.strata.dequantize(raw, int(qtype), list(shape), dtype)


def quant_matmul(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """``x [..., in] @ dequantize(raw, qtype, shape).T -> [..., out]``, ``shape == (out, in)``.

    Computed in float32 and returned in ``x.dtype``.
    """
    _raw_bytes(raw)
    if len(shape) != 2 or x.shape[-1] != shape[1]:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} does not match weight shape {tuple(shape)}")
    check_shape(qtype, shape, raw.numel())
    return torch.ops.strata.quant_matmul(x, raw, int(qtype), list(shape))


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """Quantize float values (row length last) to uint8 GGML blocks with gguf-py.

    Returns shape ``(*values.shape[:-1], row_bytes)``. UnsupportedError for a type outside
    :data:`QUANTIZABLE_TYPES`.
    """
    qtype = get_format(qtype).qtype
    if qtype not in QUANTIZABLE_TYPES:
        raise UnsupportedError(
            f"quantizing to {qtype.name} is not implemented; quantizable: {names(QUANTIZABLE_TYPES)}"
        )
    values = np.ascontiguousarray(values, dtype=np.float32)
    bytes_for(qtype, values.shape)
    encoded = np.ascontiguousarray(_gguf_quants.quantize(values, qtype))
    return encoded.view(np.uint8)
