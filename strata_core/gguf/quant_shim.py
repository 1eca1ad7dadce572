"""Bridge to the block-format code until ``strata_core.quant`` lands.

Everything in gguf/, model/ and experts/ dequantizes through the three names exported here, so
switching to ``strata_core.quant`` is automatic once it provides them: there is one dequantizer in
the product. Until then this falls back to ``gguf.quants`` (gguf-py's reference dequantizers).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf import quants as _gq

__all__ = ["dequantize", "quantize", "quant_matmul", "row_nbytes", "is_supported"]


def row_nbytes(qtype: GGMLQuantizationType, row_len: int) -> int:
    """Bytes of one row of ``row_len`` values stored as ``qtype``."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    return row_len // block * type_size


def _fallback_dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype == GGMLQuantizationType.F32:
        return raw.view(torch.float32).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(torch.float16).reshape(shape).float()
    if qtype == GGMLQuantizationType.BF16:
        return raw.view(torch.bfloat16).reshape(shape).float()
    byte_shape = (*shape[:-1], row_nbytes(qtype, shape[-1]))
    arr = _gq.dequantize(raw.numpy().reshape(byte_shape), qtype)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def _fallback_quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return _gq.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _fallback_quant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType,
                           shape: tuple[int, ...]) -> torch.Tensor:
    return x @ dequantize(raw, qtype, shape).T


def _fallback_is_supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                     GGMLQuantizationType.BF16) or qtype in _gq._type_traits


try:  # the product's own block formats, once they exist
    from strata_core.quant import dequantize, quant_matmul, quantize  # type: ignore[attr-defined]
except ImportError:
    dequantize = _fallback_dequantize
    quantize = _fallback_quantize
    quant_matmul = _fallback_quant_matmul

try:
    from strata_core.quant import is_supported  # type: ignore[attr-defined]
except ImportError:
    is_supported = _fallback_is_supported
