"""The CPU kernels' instruction set in tests.

Where the CPU has AVX-512 VNNI the CPU expert kernels take their int8 body (activations rounded to
int8 per 32 values, strata_core/ops/cpu_kernels.py): within the CUDA q8 kernels' tolerance of a float
reference, not float32's. A test whose subject is the model's math or a path's bookkeeping against a
float reference (transformers, dequantize + matmul, the grouped prefill) runs the float bodies
(:func:`float_cpu_bodies`; the ``float_cpu_kernels`` fixture of strata_core/testing/plugin.py); the int8
body's accuracy is the subject of tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from strata_core.ops.cpu_kernels import INT8_ISA, cpu_kernels

__all__ = ["FLOAT_ISA", "cpu_isa_at_most", "float_cpu_bodies"]

#: the best float body (AVX-512, or the best one below it the CPU has)
FLOAT_ISA = INT8_ISA - 1


@contextlib.contextmanager
def cpu_isa_at_most(isa: int) -> Iterator[None]:
    """The CPU kernels run with at most instruction set ``isa`` inside (``strata::cpu_kernel_limit_isa``),
    the one before restored after; nothing to do where they did not build (the torch reference runs)."""
    if not cpu_kernels():
        yield
        return
    before = torch.ops.strata.cpu_kernel_isa()
    torch.ops.strata.cpu_kernel_limit_isa(isa)
    try:
        yield
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(before)


def float_cpu_bodies() -> contextlib.AbstractContextManager[None]:
    """The CPU kernels on their float bodies inside: float32's tolerance against a float reference."""
    return cpu_isa_at_most(FLOAT_ISA)
