"""The grouped design of the CUDA decode MoE (``LaunchConfig.grouped``): each routed expert's weights are
read and decoded once per window, whatever number of its (token, expert) pairs, instead of once a pair.

A window of P pairs takes four launches, every shape fixed by P and the layer (a CUDA graph captured
for P replays for any routing; nothing is read on the host):

1. ``align``: one program sorts the pairs by expert and pads each expert's run to whole blocks of
   ``bm`` rows: ``sorted [R]`` (row r's pair, P on a padding row) and ``total [1]`` (the rows in use),
   with ``R = bm * (P // bm + min(P, E))`` rows, the most any routing needs;
2. ``gate_up``: a program per (block, ``bn_grouped`` rows of F) decodes a ``[bn_grouped, kt]`` tile of
   the block's expert's gate and up per K step and ``tl.dot``s it with the block's ``[bm, kt]``
   activations: ``h [R, F]`` float32, activated, in block order; blocks past ``total`` exit (Q4_K
   with ``fast_q4k`` and 16-byte aligned rows: 16-byte loads of its nibbles);
3. ``down``: the same over ``h`` and the down matrix (a program per block and ``bn_grouped`` rows of
   H), each pair's row stored at its pair (float32 for ``moe_decode`` / ``moe_decode_rows``, a served
   pair's row taken from ``served_rows``);
4. ``combine`` (``moe_decode``): ``out[t] = sum_j weights[t, j] * row(t * topk + j)`` in pair order.

A pair's row is computed from its own activations and its expert's weights in the same order whatever
other pairs share its block, so peer rows (``moe_decode_rows``) merge with the home's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.experts.ffn import ExpertFFN
from strata_core.ops import moe
from strata_core.ops.moe import _shapes
from strata_core.ops.moe_grouped_kernels import (_align_kernel, _combine_pairs_kernel, _grouped_down_kernel,
                                                  _grouped_gate_up_kernel)
from strata_core.ops.moe_sources import Sources, aligned16, or_unread
from strata_core.ops.qdecode import block_geometry, table

__all__ = ["align", "combine_pairs", "grouped_gate_up", "grouped_rows"]

#: pairs the align program compares at a time against all of them
_ALIGN_CHUNK = 16


def _geometry(qtype: int, sources: Sources, offset: int, row_bytes: int) -> tuple[int, int, int, bool]:
    """``(block size, type size, sub-block size, fast)`` of the matrix at byte ``offset`` of an expert:
    ``fast``, its Q4_K nibbles read as 16-byte loads (``LaunchConfig.fast_q4k``, aligned rows, ``kt`` of
    whole 64-value chunks)."""
    cfg = moe.launch_config()
    fast = (cfg.fast_q4k and int(qtype) == int(T.Q4_K) and cfg.kt % 64 == 0
            and aligned16(sources.args, offset, row_bytes))
    return (*block_geometry(qtype), fast)


def align(expert: Tensor, bm: int, n_experts: int) -> tuple[Tensor, Tensor]:
    """``(sorted [R], total [1])`` int32 of the pairs ``expert [P]`` (module doc, step 1); ``n_experts``
    bounds the distinct experts (``R = bm * (P // bm + min(P, n_experts))``)."""
    P = expert.shape[0]
    sorted_ = torch.empty(bm * (P // bm + min(P, n_experts)), dtype=torch.int32, device=expert.device)
    total = torch.empty(1, dtype=torch.int32, device=expert.device)
    block = max(16, triton.next_power_of_2(P))
    _align_kernel[(1,)](expert.contiguous(), sorted_, total, P, BM=bm, PB=block, QC=_ALIGN_CHUNK,
                        num_warps=4 if block <= 128 else 8)
    return sorted_, total


def grouped_gate_up(x: Tensor, sources: Sources, topk: int, qtypes: Sequence[int], shapes: Sequence[int],
                    nbytes: Sequence[int], ffn: ExpertFFN, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 1 and 2 of the module doc: ``(h [R, F], sorted [R], total [1])``."""
    cfg = moe.launch_config()
    (F_, H), _, _ = _shapes(shapes)
    slot, expert = sources.args[:2]
    P = slot.shape[0]
    sorted_, total = align(expert, cfg.bm, n_experts)
    h = torch.empty((sorted_.shape[0], F_), dtype=torch.float32, device=x.device)  # [R, F]
    bsg, tsg, subg, fastg = _geometry(qtypes[0], sources, 0, nbytes[0] // F_)
    bsu, tsu, subu, fastu = _geometry(qtypes[1], sources, nbytes[0], nbytes[1] // F_)
    _grouped_gate_up_kernel[(sorted_.shape[0] // cfg.bm, triton.cdiv(F_, cfg.bn_grouped))](
        x, h, sorted_, total, *sources.args, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, P, topk,
        nbytes[0], nbytes[0] // F_, nbytes[1] // F_, or_unread(ffn.gate_bias, h), or_unread(ffn.up_bias, h), expert,
        float(ffn.alpha), float(ffn.limit), QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, FASTG=fastg,
        QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, FASTU=fastu, BM=cfg.bm, BN=cfg.bn_grouped, KT=cfg.kt,
        BY_PAIR=sources.staged, BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai",
        PREC=cfg.dot_precision, num_warps=cfg.warps_grouped)
    return h, sorted_, total


def grouped_rows(x: Tensor, sources: Sources, topk: int, qtypes: Sequence[int], shapes: Sequence[int],
                 nbytes: Sequence[int], ffn: ExpertFFN, n_experts: int, dtype: torch.dtype,
                 served: Tensor | None = None, served_rows: Tensor | None = None) -> Tensor:
    """Every pair's row ``[P, H]`` in ``dtype`` (steps 1 to 3 of the module doc): the pairs of
    ``sources`` on the tokens ``x [T, H]`` (pair p on token ``p // topk``), ``ffn``'s biases and
    activation applied; a pair flagged in ``served [P]`` (uint8) takes its float32 row of
    ``served_rows [P, H]``."""
    cfg = moe.launch_config()
    _, _, (H2, F2) = _shapes(shapes)
    h, sorted_, total = grouped_gate_up(x, sources, topk, qtypes, shapes, nbytes, ffn, n_experts)
    expert = sources.args[1]
    P = expert.shape[0]
    rows = torch.empty((P, H2), dtype=dtype, device=x.device)  # [P, H]
    bs, ts, sub, fast = _geometry(qtypes[2], sources, nbytes[0] + nbytes[1], nbytes[2] // H2)
    _grouped_down_kernel[(sorted_.shape[0] // cfg.bm, triton.cdiv(H2, cfg.bn_grouped))](
        h, rows, sorted_, total, *sources.args, table(qtypes[2], x.device), H2, F2, P, nbytes[0] + nbytes[1],
        nbytes[2] // H2, or_unread(ffn.down_bias, h), expert, or_unread(served, h), or_unread(served_rows, h),
        QT=int(qtypes[2]), BS=bs, TS=ts, SUB=sub, FAST=fast, BM=cfg.bm, BN=cfg.bn_grouped, KT=cfg.kt,
        BY_PAIR=sources.staged, BIAS=ffn.down_bias is not None, SERVED=served is not None, PREC=cfg.dot_precision,
        num_warps=cfg.warps_grouped)
    return rows


def combine_pairs(rows: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """Step 4 of the module doc: ``[T, H]`` in ``dtype`` from the float32 ``rows [T*k, H]`` and
    ``weights [T, k]``."""
    (T, k), H = weights.shape, rows.shape[1]
    out = torch.empty((T, H), dtype=dtype, device=rows.device)
    bn = min(1024, triton.next_power_of_2(H))
    _combine_pairs_kernel[(T, triton.cdiv(H, bn))](rows, weights.contiguous(), out, H, k, BN=bn, num_warps=4)
    return out
