"""The tolerance of a result against a float reference where the CPU's int8 expert body computed it.

Where the CPU has AVX-512 VNNI the CPU kernels quantize the activations of Q4_0 / Q8_0 / K-quant experts
to int8 per 32 values (strata_core/ops/cpu_kernels.py), as the CUDA q8 MoE kernels do, so logits built on
them keep within those kernels' tolerance of a float32 reference (a relative Frobenius 2e-2,
tests/test_moe_q8.py) rather than float32's. Comparisons between two Strata paths that both run the
kernels stay bit for bit; only those against a float reference (transformers, the dequantize + matmul
reference, the grouped prefill) take this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from strata_core.ops.cpu_kernels import int8_activations

__all__ = ["Q8_TOL", "assert_close_or_q8"]

#: relative (Frobenius) tolerance of the CUDA q8 kernels and the CPU's int8 body
Q8_TOL = 2e-2


def assert_close_or_q8(got: torch.Tensor, want: torch.Tensor, qtypes: Iterable[int], **float_tol) -> None:
    """``torch.testing.assert_close(got, want, **float_tol)``; where the CPU's int8 body computes experts of
    ``qtypes`` here, ``got`` within a relative (Frobenius) :data:`Q8_TOL` of ``want`` instead."""
    if int8_activations(list(qtypes)):
        got, want = got.double(), want.double()
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < Q8_TOL, f"relative (Frobenius) error {err:.3g} over the q8 tolerance {Q8_TOL}"
    else:
        torch.testing.assert_close(got, want, **float_tol)
