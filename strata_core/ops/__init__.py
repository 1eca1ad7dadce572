"""Strata's torch custom ops, all in the ``strata`` namespace, registered at import.

- ``strata::dequantize(Tensor raw, int qtype, SymInt[] shape) -> Tensor``
- ``strata::quant_matmul(Tensor x, Tensor raw, int qtype, SymInt[] shape) -> Tensor``
- ``strata::gather_experts(...)``: routed experts' packed bytes from device slots or, zero-copy,
  from the pinned arena (a Triton kernel on CUDA; see :mod:`strata_core.ops.gather`)

:mod:`strata_core.ops.matmul` holds the batch-invariant CPU products the model uses.

Each op has one contract, a device-generic torch reference kernel and a fake (meta) kernel; device
kernels register for the same op. Import this package before any graph capture.
"""

from strata_core.ops import quant

__all__ = ["quant"]
