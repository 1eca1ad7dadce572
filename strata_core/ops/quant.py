"""``strata::dequantize`` and ``strata::quant_matmul``: GGML block formats as torch custom ops.

- ``dequantize(Tensor raw, int qtype, SymInt[] shape, ScalarType? dtype=None) -> Tensor``: the
  values in ``dtype`` (float32 when None).
- ``quant_matmul(Tensor x, Tensor raw, int qtype, SymInt[] shape) -> Tensor``: ``x @ W.T`` computed
  in float32, returned in ``x.dtype``.

The device-generic torch reference of :mod:`strata_core.quant.registry` is the exactness oracle. On
the CPU ``dequantize`` runs the compiled block decoders (ops/cpu_kernels.py: the same values, bit for
bit, threaded) for the formats they cover, the reference for the others.
With Triton installed a CUDA kernel registers for each op (``register_kernel("cuda")``, opaque to
tracing because it may fall back to the reference): the Triton dequantizer of
:mod:`strata_core.ops.dequant` for every format of ``KERNEL_TYPES``, written straight in the asked
dtype; the others run the reference, logged once. Callers (``strata_core.quant.dequantize`` /
``quant_matmul``) never change.

Tolerance of the CUDA kernel against the reference: float32 results within a relative 1e-6
(the only difference is fused multiply-adds); bf16 / fp16 results are the float32 values rounded
once (tests/test_kernels_cuda.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.ops.cpu_kernels import dequantize_blocks
from strata_core.ops.dequant import dequantize_cuda, fallback_note
from strata_core.ops.matmul import linear
from strata_core.ops.qdecode import HAS_TRITON
from strata_core.quant.registry import dequantize_reference

__all__ = ["dequantize", "quant_matmul"]

_DEQUANTIZE = "(Tensor raw, int qtype, SymInt[] shape, ScalarType? dtype=None) -> Tensor"
_QUANT_MATMUL = "(Tensor x, Tensor raw, int qtype, SymInt[] shape) -> Tensor"


def _dequantize_ref(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    """The reference kernel: float32 values of ``shape``, cast to ``dtype`` if given."""
    out = dequantize_reference(raw, qtype, shape)
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def _dequantize_cpu(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    """The compiled block decoders where they cover the format (the reference's bits), else the reference."""
    out = dequantize_blocks(raw, qtype, dtype)
    if out is None:
        return _dequantize_ref(raw, qtype, shape, dtype)
    return out.reshape(shape)


def _quant_matmul_ref(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    weight = dequantize_reference(raw, qtype, shape)  # [out, in]
    return linear(x.float(), weight).to(x.dtype)  # [..., out]


def _dequantize_any(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    """The Triton kernel on CUDA where the format has one, else the reference."""
    if raw.device.type == "cuda":
        out = dequantize_cuda(raw, qtype, shape, dtype or torch.float32)
        if out is not None:
            return out
        fallback_note(qtype, "strata::dequantize")
    return _dequantize_ref(raw, qtype, shape, dtype)


def _quant_matmul_any(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    weight = _dequantize_any(raw, qtype, shape)  # [out, in] float32
    return linear(x.float(), weight).to(x.dtype)  # [..., out]


dequantize = torch.library.custom_op("strata::dequantize", _dequantize_ref, mutates_args=(), schema=_DEQUANTIZE)
quant_matmul = torch.library.custom_op("strata::quant_matmul", _quant_matmul_ref, mutates_args=(),
                                       schema=_QUANT_MATMUL)
dequantize.register_kernel("cpu")(_dequantize_cpu)
if HAS_TRITON:  # opaque CUDA kernels: their fallback to the reference is not traceable
    dequantize.register_kernel("cuda")(_dequantize_any)
    quant_matmul.register_kernel("cuda")(_quant_matmul_any)


@dequantize.register_fake
def _(raw: Tensor, qtype: int, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    return raw.new_empty(shape, dtype=dtype or torch.float32)


@quant_matmul.register_fake
def _(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    return x.new_empty((*x.shape[:-1], shape[0]))
