"""How the CUDA kernels of :mod:`strata_core.ops.moe` are launched (the Triton kernels themselves:
:mod:`strata_core.ops.moe_kernels`).

``pair_rows_cuda``, ``decode_cuda`` and ``decode_rows_cuda`` are the CUDA kernels of
``strata::moe_pair_rows``, ``strata::moe_decode`` and ``strata::moe_decode_rows`` (the module doc of
:mod:`strata_core.ops.moe` says what they compute and how): the gate_up launch, the down / combining
down launch of the "loop" or "split" design that ``moe.launch_config()`` (:class:`~strata_core.ops.moe.LaunchConfig`,
read at each launch) names, or for a window of enough pairs the grouped design's launches
(:mod:`strata_core.ops.moe_grouped`), and the staging of misses from a pinned host arena (unless the
op's ``direct_misses``; :mod:`strata_core.ops.moe_sources`).
Each registers itself for its op at import; :mod:`strata_core.ops` imports this module where Triton
is installed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.ops import moe
from strata_core.ops.dequant import fallback_note
from strata_core.ops.gather import gather_experts
from strata_core.ops.moe import _combined, _ffn, _reference, _shapes
from strata_core.ops.moe_grouped import combine_pairs, grouped_rows
from strata_core.ops.moe_kernels import _gate_up_kernel, _down_kernel, _down_combine_kernel, _gate_up_split_kernel, _down_split_kernel
from strata_core.ops.moe_q8 import down_q8, gate_up_q8, takes_q8
from strata_core.ops.moe_sources import Sources, aligned16, or_unread, weight_sources
from strata_core.ops.qdecode import KERNEL_TYPES, block_geometry, on_device, table

__all__ = ["decode_cuda", "decode_rows_cuda", "pair_rows_cuda"]


def _steps(qtype: int, rows: int) -> tuple[int, int, int, int]:
    """(block size, type size, sub-block size, sub-blocks per step) of ``qtype`` for ``rows`` rows a
    program (``moe.launch_config().tile`` values a step, at least one block)."""
    bs, ts, sub = block_geometry(qtype)
    return bs, ts, sub, max(bs // sub, moe.launch_config().tile // (rows * sub))

def _fast_steps(qtype: int, rows: int, offset: int, row_bytes: int, src: tuple) -> tuple[int, int, int, int, bool]:
    """``_steps`` of the split design, and whether the matrix at byte ``offset`` of an expert is read by
    16-byte loads (Q4_K with ``moe.launch_config().fast_q4k`` and every address 16-byte aligned; then a step is
    ``NT`` 64-value chunks, at least one block)."""
    fast = moe.launch_config().fast_q4k and int(qtype) == int(T.Q4_K) and aligned16(src, offset, row_bytes)
    if not fast:
        return (*_steps(qtype, rows), False)
    bs, ts, _ = block_geometry(qtype)
    return bs, ts, 32, max(4, moe.launch_config().tile // (rows * 64)), True

def _fallback_rows(op: str, x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                   qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], ffn: tuple,
                   by_pair: bool = False) -> Tensor:
    """The reference rows ``[P, H]`` on the device, for formats without a decoder (logged once for ``op``):
    ``moe._reference`` with the device gather reading ``arena`` where it is."""
    fallback_note(next(q for q in qtypes if int(q) not in KERNEL_TYPES), op)
    return _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn, by_pair=by_pair,
                      gather=gather_experts)

def _decodes(qtypes: Sequence[int]) -> bool:
    """Whether the Triton kernels decode every matrix of these formats."""
    return all(int(q) in KERNEL_TYPES for q in qtypes)

def pair_rows_cuda(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
             qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
             direct_misses: bool = False) -> Tensor:
    """The CUDA kernel (see the module doc); the reference for formats without a decoder."""
    if not _decodes(qtypes):
        return _fallback_rows("strata::moe_pair_rows", x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, ffn)
    with on_device(x.device):  # Triton launches on the current device
        return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, None, _ffn(*ffn),
                           direct_misses=direct_misses)

def _q8_matrices(x: Tensor, sources: Sources, qtypes: Sequence[int], shapes: Sequence[int],
                 nbytes: Sequence[int]) -> list[bool]:
    """Whether the q8 design serves each of the gate, up and down matrices (``takes_q8``)."""
    return [takes_q8(x, q, sources.args, sum(nbytes[:i]), nbytes[i] // shapes[2 * i]) for i, q in enumerate(qtypes)]

def _gate_up(x: Tensor, sources: Sources, topk: int, qtypes: Sequence[int], shapes: Sequence[int],
             nbytes: Sequence[int], ffn: ExpertFFN = SILU, q8: Sequence[bool] | None = None) -> Tensor:
    """``silu(gate x) * up x`` of every pair of ``sources`` (or ``ffn``'s activation of the biased
    products): the loop, split or q8 design's gate_up launch, float32 ``[P, F]`` (split partial products:
    ``_gate_up_split``; the q8 design where it serves both matrices (``q8``: ``_q8_matrices``, found here
    when not given), else the split design's)."""
    (F_, H), _, _ = _shapes(shapes)
    q8 = _q8_matrices(x, sources, qtypes, shapes, nbytes) if q8 is None else q8
    if q8[0] and q8[1]:
        return gate_up_q8(x, sources, topk, F_, H, nbytes, ffn)
    gate_up = _gate_up_loop if moe.launch_config().design == "loop" else _gate_up_split
    return gate_up(x, sources.args, sources.staged, topk, qtypes, F_, H, nbytes, ffn)

def _gate_up_loop(x: Tensor, src: tuple, staged: bool, topk: int, qtypes: Sequence[int], F_: int, H: int,
                  nbytes: Sequence[int], ffn: ExpertFFN) -> Tensor:
    """The loop design's gate_up launch (``LaunchConfig``): ``h [P, F]``."""
    h = torch.empty((src[0].shape[0], F_), dtype=torch.float32, device=x.device)  # [P, F]
    bn = moe.launch_config().bn_gate_up
    (bsg, tsg, subg, ntg), (bsu, tsu, subu, ntu) = (_steps(q, bn) for q in qtypes[:2])
    _gate_up_kernel[(h.shape[0], triton.cdiv(F_, bn))](
        x, h, *src, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, topk,
        nbytes[0], nbytes[0] // F_, nbytes[1] // F_, or_unread(ffn.gate_bias, h), or_unread(ffn.up_bias, h), src[1],
        float(ffn.alpha), float(ffn.limit),
        QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, NTG=ntg,
        QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, NTU=ntu, BN=bn, BY_PAIR=staged,
        BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai", num_warps=moe.launch_config().warps_gate_up)
    return h

def _gate_up_split(x: Tensor, src: tuple, staged: bool, topk: int, qtypes: Sequence[int], F_: int, H: int,
                   nbytes: Sequence[int], ffn: ExpertFFN) -> Tensor:
    """The split design's gate_up launch: ``h [P, F]`` (``split_k == 1``) or the partial products
    ``[2 * split_k, P, F]`` (gates, then ups)."""
    P, bn, S = src[0].shape[0], moe.launch_config().bn_gate_up, moe.launch_config().split_k
    h = torch.empty((P, F_) if S == 1 else (2 * S, P, F_), dtype=torch.float32, device=x.device)
    bsg, tsg, subg, ntg, fastg = _fast_steps(qtypes[0], bn, 0, nbytes[0] // F_, src)
    bsu, tsu, subu, ntu, fastu = _fast_steps(qtypes[1], bn, nbytes[0], nbytes[1] // F_, src)
    unit = max(bsg, bsu)
    ks = triton.cdiv(triton.cdiv(H, S), unit) * unit  # values of a split, whole blocks of both
    _gate_up_split_kernel[(P, triton.cdiv(F_, bn), S)](
        x, h, *src, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, ks, P * F_, topk,
        nbytes[0], nbytes[0] // F_, nbytes[1] // F_, or_unread(ffn.gate_bias, h), or_unread(ffn.up_bias, h), src[1],
        float(ffn.alpha), float(ffn.limit),
        QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, NTG=ntg, FASTG=fastg,
        QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, NTU=ntu, FASTU=fastu, BN=bn, BY_PAIR=staged,
        BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai", SPLIT=S,
        num_warps=moe.launch_config().warps_gate_up)
    return h

def _moe_triton(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                weights: Tensor | None = None, ffn: ExpertFFN = SILU, served: Tensor | None = None,
                served_rows: Tensor | None = None, rows_out: bool = False, by_pair: bool = False,
                direct_misses: bool = False) -> Tensor:
    """The Triton launches of the design ``moe.launch_config()`` picks for P pairs (and the staging copy
    of misses in a host arena); the rows ``[P, H]``, or with ``weights [T, topk]`` their combination
    ``[T, H]``; ``ffn``'s biases and activation applied in the launches. With ``weights``: ``served [P]``
    / ``served_rows [P, H]`` float32 rows taken in place of the flagged pairs' own, or (``rows_out``)
    the float32 rows ``[P, H]`` the combination would sum, returned instead (``moe_decode_rows``).
    ``by_pair``: ``arena`` holds the misses staged already, a row per pair (``moe_decode``'s ``staged``);
    ``direct_misses``: the misses in a host ``arena`` read in place, not staged."""
    slot, expert, x = slot.contiguous(), expert.contiguous(), x.contiguous()
    _, _, (H2, F2) = _shapes(shapes)
    P = slot.shape[0]
    if (ffn.gate_bias is None) != (ffn.up_bias is None):
        raise ValueError("strata::moe_pair_rows: the kernel takes both gate and up biases or neither")
    if P and moe.launch_config().groups(P):
        sources = weight_sources(slots, arena, slot, expert, sum(nbytes), by_pair, direct_misses)
        rows = grouped_rows(x, sources, topk, qtypes, shapes, nbytes, ffn, arena.shape[0],
                            x.dtype if weights is None else torch.float32, served, served_rows)
        return rows if weights is None or rows_out else combine_pairs(rows, weights, x.dtype)
    out = (torch.empty((P, H2), dtype=torch.float32, device=x.device) if rows_out else
           torch.empty((P if weights is None else x.shape[0], H2), dtype=x.dtype, device=x.device))
    if P == 0:
        return out.zero_()
    sources = weight_sources(slots, arena, slot, expert, sum(nbytes), by_pair, direct_misses)
    q8 = _q8_matrices(x, sources, qtypes, shapes, nbytes)
    h = _gate_up(x, sources, topk, qtypes, shapes, nbytes, ffn, q8)
    src, staged = sources.args, sources.staged
    down = (or_unread(ffn.down_bias, h), expert)
    if rows_out:
        modes = dict(served=h, rows_buf=out, SERVED=False, ROWS_OUT=True)
    elif served is not None:
        modes = dict(served=served.contiguous(), rows_buf=served_rows.contiguous(), SERVED=True, ROWS_OUT=False)
    else:  # the kernels' served-rows arguments, unread
        modes = dict(served=h, rows_buf=h, SERVED=False, ROWS_OUT=False)
    if h.dim() == 2 and q8[2]:
        down_q8(h, out, weights, sources, topk, H2, F2, nbytes, ffn, modes)
    elif moe.launch_config().design in ("split", "q8"):
        _down_split(h, out, weights, src, staged, topk, qtypes, H2, F2, nbytes, ffn, modes)
    elif weights is None:
        bn = moe.launch_config().bn_down
        bsd, tsd, subd, ntd = _steps(qtypes[2], bn)
        _down_kernel[(P, triton.cdiv(H2, bn))](
            h, out, *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1], nbytes[2] // H2, *down,
            QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=bn, BY_PAIR=staged,
            BIAS=ffn.down_bias is not None, num_warps=moe.launch_config().warps_down)
    else:
        bn = moe.launch_config().bn_combine
        bsd, tsd, subd, ntd = _steps(qtypes[2], bn)
        _down_combine_kernel[(x.shape[0], triton.cdiv(H2, bn))](
            h, out, weights.contiguous(), *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1],
            nbytes[2] // H2, topk, *down, modes["served"], modes["rows_buf"],
            QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=bn, BY_PAIR=staged,
            BIAS=ffn.down_bias is not None, SERVED=modes["SERVED"], ROWS_OUT=modes["ROWS_OUT"],
            num_warps=moe.launch_config().warps_combine)
    return out

def _down_split(h: Tensor, out: Tensor, weights: Tensor | None, src: tuple, staged: bool, topk: int,
                qtypes: Sequence[int], H2: int, F2: int, nbytes: Sequence[int], ffn: ExpertFFN,
                modes: dict) -> None:
    """The split design's down launch into ``out``: the rows of every pair (``weights`` None; a program
    per pair and ``bn_down`` rows), or each token's pairs at once, combined (``bn_combine`` rows);
    ``modes``: the served-rows arguments of the kernel (``_moe_triton``)."""
    P = src[0].shape[0]
    combine = weights is not None
    J = triton.next_power_of_2(topk) if combine else 1
    bn = moe.launch_config().bn_combine if combine else moe.launch_config().bn_down
    off = nbytes[0] + nbytes[1]
    bsd, tsd, subd, ntd, fast = _fast_steps(qtypes[2], J * bn, off, nbytes[2] // H2, src)
    programs = weights.shape[0] if combine else P
    _down_split_kernel[(programs, triton.cdiv(H2, bn))](
        h, out, weights.contiguous() if combine else h, *src, table(qtypes[2], h.device), H2, F2, P, P * F2,
        off, nbytes[2] // H2, topk, or_unread(ffn.gate_bias, h), or_unread(ffn.up_bias, h), or_unread(ffn.down_bias, h), src[1],
        float(ffn.alpha), float(ffn.limit),
        QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, FAST=fast, J=J, BN=bn, BY_PAIR=staged,
        GU_BIAS=h.dim() == 3 and ffn.gate_bias is not None, BIAS=ffn.down_bias is not None,
        OAI=ffn.activation == "swiglu_oai", HS=0 if h.dim() == 2 else h.shape[0] // 2, COMBINE=combine,
        **modes, num_warps=moe.launch_config().warps_combine if combine else moe.launch_config().warps_down)

def decode_cuda(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                act: int = 0, alpha: float = 1.702, limit: float = 7.0, served: Tensor | None = None,
                served_rows: Tensor | None = None, staged: bool = False, direct_misses: bool = False) -> Tensor:
    """``moe_decode`` on CUDA: the rows combined in the down launch (the ``served`` pairs' rows taken
    from ``served_rows``; ``staged``: the misses read from ``arena``'s row of their pair); the
    reference's combination of the fallback rows for formats without a decoder."""
    ffn = (gate_bias, up_bias, down_bias, act, alpha, limit)
    if not _decodes(qtypes):
        return _combined(_fallback_rows("strata::moe_decode", x, slots, arena, slot, expert, topk, qtypes, shapes,
                                        nbytes, ffn, staged), weights, served, served_rows)
    with on_device(x.device):
        return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, weights, _ffn(*ffn),
                           None if served is None else served.view(torch.uint8), served_rows, by_pair=staged,
                           direct_misses=direct_misses)

def decode_rows_cuda(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
              qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
              direct_misses: bool = False) -> Tensor:
    """``moe_decode_rows`` on CUDA: the combining down launch storing its float32 rows instead of
    summing them (the same arithmetic, row for row); the fallback rows in float32 for formats
    without a decoder."""
    if not _decodes(qtypes):
        return _fallback_rows("strata::moe_decode_rows", x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes,
                              ffn).float()
    unread = torch.empty((x.shape[0], topk), dtype=torch.float32, device=x.device)  # the combination's shape
    with on_device(x.device):
        return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, unread, _ffn(*ffn),
                           rows_out=True, direct_misses=direct_misses)


# opaque like strata::dequantize: a CUDA kernel may fall back to the reference
moe.moe_pair_rows.register_kernel("cuda")(pair_rows_cuda)
moe.moe_decode.register_kernel("cuda")(decode_cuda)
moe.moe_decode_rows.register_kernel("cuda")(decode_rows_cuda)
