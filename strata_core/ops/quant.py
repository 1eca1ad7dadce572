"""``strata::dequantize`` and ``strata::quant_matmul``: GGML block formats as torch custom ops.

The default kernel of each op is the device-generic torch reference of
:mod:`strata_core.quant.registry`; on the CPU it is *the* implementation. A fused device kernel
registers for the same op (``dequantize.register_kernel("cuda")`` or ``torch.library.triton_op``),
may hand the formats it does not cover back to :func:`dequantize_reference`, and callers
(``strata_core.quant.dequantize`` / ``quant_matmul``) never change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.ops.matmul import linear
from strata_core.quant.registry import dequantize_reference


@torch.library.custom_op(
    "strata::dequantize",
    mutates_args=(),
    schema="(Tensor raw, int qtype, SymInt[] shape) -> Tensor",
)
def dequantize(raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """uint8 GGML blocks -> float32 tensor of ``shape``."""
    return dequantize_reference(raw, qtype, shape)


@dequantize.register_fake
def _(raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    return raw.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op(
    "strata::quant_matmul",
    mutates_args=(),
    schema="(Tensor x, Tensor raw, int qtype, SymInt[] shape) -> Tensor",
)
def quant_matmul(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """``x [..., in] @ W.T -> [..., out]`` for a block-quantized ``W`` of ``shape == [out, in]``.

    Computed in float32, returned in ``x.dtype``.
    """
    weight = dequantize_reference(raw, qtype, shape)  # [out, in]
    return linear(x.float(), weight).to(x.dtype)  # [..., out]


@quant_matmul.register_fake
def _(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    return x.new_empty((*x.shape[:-1], shape[0]))
