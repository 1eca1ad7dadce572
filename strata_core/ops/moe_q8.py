"""The "q8" design of the CUDA decode MoE (``LaunchConfig.design == "q8"``): Q4_K experts dotted with
int8-quantized activations by ``dp4a`` (:mod:`strata_core.ops.moe_q8_kernels` says how).

A layer takes four launches (shapes fixed by the pairs and the layer; capturable in a CUDA graph):
the tokens' activations quantized (``quantize_q8``), the gate_up launch (a program per pair and
``bn_gate_up`` rows: ``h [P, F]`` float32, activated), ``h`` quantized, and the down launch (a
program per token and ``bn_combine`` rows summing its pairs in pair order, or per pair and
``bn_down`` rows for the rows of ``moe_pair_rows``). It serves windows of ``q8_pairs`` pairs or more of
bf16 / fp16 activations on Q4_K matrices whose every row is 16-byte aligned (:func:`takes_q8`); the
split design serves the rest, a half of the layer at a time (a Q6_K down matrix after a Q4_K gate_up).
A pair's row depends on its own token's activations alone (each token quantized by itself), so the
rows of any batch are those of the pairs alone in a window of the design. Quantizing the activations
costs accuracy like llama.cpp's GPU path: within the bf16 tolerance of the reference (2e-2 relative,
tests/test_moe_q8.py), not the float32 one, so float32 activations take the split design.
"""

from __future__ import annotations

import torch
import triton
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.experts.ffn import ExpertFFN
from strata_core.ops import moe
from strata_core.ops.moe_q8_kernels import _down_q8_kernel, _gate_up_q8_kernel, _quantize_q8_kernel
from strata_core.ops.moe_sources import Sources, aligned16, or_unread

__all__ = ["down_q8", "gate_up_q8", "quantize_q8", "takes_q8"]

#: blocks of 32 values a program of ``quantize_q8`` takes
_QUANT_BLOCKS = 8


def takes_q8(x: Tensor, qtype: int, args: tuple, offset: int, row_bytes: int) -> bool:
    """Whether the q8 design serves the matrix at byte ``offset`` of an expert (``row_bytes`` a row)
    for activations like ``x``: the design in force, a window of ``q8_pairs`` pairs or more
    (``args[0]``: their slots), Q4_K, 16-byte aligned rows in every source (``Sources.args``), bf16 /
    fp16 activations."""
    cfg = moe.launch_config()
    return (cfg.design == "q8" and args[0].shape[0] >= cfg.q8_pairs and int(qtype) == int(T.Q4_K)
            and x.dtype != torch.float32 and aligned16(args, offset, row_bytes))


def quantize_q8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(words [R, K/4] int32, scales [R, K/32], sums [R, K/32])`` of ``x [R, K]`` (K a multiple of
    256): each 32 values as int8 codes (the words: four codes each), ``max |v| / 127`` and their sum."""
    R, K = x.shape
    q = torch.empty((R, K), dtype=torch.int8, device=x.device)
    d = torch.empty((R, K // 32), dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    if R:
        _quantize_q8_kernel[(R, triton.cdiv(K // 32, _QUANT_BLOCKS))](x.contiguous(), q, d, s, K, G=_QUANT_BLOCKS,
                                                                      num_warps=2)
    return q.view(torch.int32), d, s


def _blocks(rows: int, K: int) -> int:
    """Q4_K blocks of every row a program step reads: ``LaunchConfig.tile`` values over ``rows`` rows,
    at least one, at most the row's (rounded up to a power of two)."""
    return max(1, min(moe.launch_config().tile // (rows * 256), triton.next_power_of_2(K // 256)))


def gate_up_q8(x: Tensor, sources: Sources, topk: int, F_: int, H: int, nbytes: tuple, ffn: ExpertFFN) -> Tensor:
    """``h [P, F]`` float32: ``ffn``'s activation of every pair's gate and up products (Q4_K both)."""
    cfg = moe.launch_config()
    P = sources.args[0].shape[0]
    h = torch.empty((P, F_), dtype=torch.float32, device=x.device)
    xw, xd, xs = quantize_q8(x)
    bn = cfg.bn_gate_up
    _gate_up_q8_kernel[(P, triton.cdiv(F_, bn))](
        xw, xd, xs, h, *sources.args, F_, H, topk, nbytes[0], nbytes[0] // F_, nbytes[1] // F_,
        or_unread(ffn.gate_bias, h), or_unread(ffn.up_bias, h), sources.args[1], float(ffn.alpha), float(ffn.limit),
        BN=bn, BK=_blocks(bn, H), BY_PAIR=sources.staged, BIAS=ffn.gate_bias is not None,
        OAI=ffn.activation == "swiglu_oai", num_warps=cfg.warps_q8)
    return h


def down_q8(h: Tensor, out: Tensor, weights: Tensor | None, sources: Sources, topk: int, H2: int, F2: int,
            nbytes: tuple, ffn: ExpertFFN, modes: dict) -> None:
    """The down launch into ``out`` (Q4_K down): each token's pairs combined (``weights [T, topk]``) or
    every pair's row (``weights`` None); ``modes``: the served-rows arguments (``_moe_triton``)."""
    cfg = moe.launch_config()
    P = sources.args[0].shape[0]
    combine = weights is not None
    hw, hd, hs = quantize_q8(h)
    bn = cfg.bn_combine if combine else cfg.bn_down
    _down_q8_kernel[(weights.shape[0] if combine else P, triton.cdiv(H2, bn))](
        hw, hd, hs, out, weights.contiguous() if combine else h, *sources.args, H2, F2, nbytes[0] + nbytes[1],
        nbytes[2] // H2, topk if combine else 1, or_unread(ffn.down_bias, h), sources.args[1], modes["served"],
        modes["rows_buf"], BN=bn, BK=_blocks(bn, F2), BY_PAIR=sources.staged, BIAS=ffn.down_bias is not None,
        COMBINE=combine, SERVED=modes["SERVED"], ROWS_OUT=modes["ROWS_OUT"],
        num_warps=cfg.warps_q8)
