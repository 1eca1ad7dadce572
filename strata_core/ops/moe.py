"""``strata::moe_pair_rows``: every routed (token, j) pair's expert FFN, read from wherever the expert is.

``moe_pair_rows(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes) -> [P, H]``

- ``x [T, H]``: the MoE input of the window's tokens; pair p computes on token ``p // topk``;
- ``slots [S, >= total]`` uint8: a device's expert cache; ``arena [E, total]`` uint8: the layer's
  packed experts (pinned host memory, or a device tensor);
- ``slot [P]``: pair p's cache slot, -1 = not resident (read ``arena[expert[p]]``); ``expert [P]``;
- ``qtypes`` / ``shapes`` / ``nbytes``: the gate, up and down matrices of one packed expert
  (``shapes`` flat: gate ``[F, H]``, up ``[F, H]``, down ``[H, F]``).

Row p is ``down_e(silu(gate_e x) * up_e x)`` for ``e = expert[p]``, in ``x.dtype``. The optional
trailing arguments (``ffn_args(ExpertFFN)``: ``gate_bias``, ``up_bias``, ``down_bias``, ``act``,
``alpha``, ``limit``) add expert e's biases to its gate/up products and to its row and pick the
activation (gpt-oss: swiglu_oai); the CUDA kernels apply them in registers. The op knows nothing of
topologies or residency tables: a caller finds ``slot`` from its table on the device.

CPU kernel (the oracle): the gather reference of :mod:`strata_core.ops.gather`, then
:func:`pair_ffn_reference` (dequantize every pair's blocks, per-pair batched products in float32,
cast step by step like ``expert_ffn``).

CUDA kernel: two Triton launches that read the quantized blocks once and never write a weight:
``gate_up`` (grid pairs x F/BN: each program decodes BN rows of gate and of up with the shared
:func:`strata_core.ops.qdecode.decode`, dots them with the token's activations in float32 and
stores ``silu(g) * u``) and ``down`` (grid pairs x H/BN, the same over the float32 ``h``). A pair's
weights are found on the device: ``slots + slot * stride`` when resident; a miss in a pinned host
arena is first copied over the link into a device staging row by the gather kernel, which skips
resident pairs (``MISS_READ = "staged"``: the copy moves 8-byte words at ~93% of the link, where
byte-wise decoding loads straight from host memory would not), or read zero-copy by the decode
kernels (``"direct"``). No host read of the routing either way: one fixed launch sequence a
layer, capturable in a CUDA graph. Formats outside ``KERNEL_TYPES`` run the reference on the
device (logged once).

``moe_decode(x, slots, arena, slot, expert, weights, topk, qtypes, shapes, nbytes) -> [T, H]`` is the
same with the rows combined: ``sum_j weights[t, j] * row(t * topk + j)`` (``combine_rows``); on CUDA
its down launch sums a token's pairs in registers in that fixed order (grid tokens x H/BN), so a
decode layer's routed output takes two launches and no ``[P, H]`` rows.

Rows computed on another device (a peer tier, experts/device_rows.py) join that combination exactly:
``moe_decode_rows(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes) -> [P, H]`` float32 is
the combining launch storing each pair's row instead of summing it (the same tiles, the same
arithmetic), and ``moe_decode(..., served=[P] bool, served_rows=[P, H] float32)`` takes those rows in
place of its own for the flagged pairs, so the output is bit for bit that of one device holding every
expert, whichever device computed which row (tests/test_moe_served.py).

How the launches split the work (rows per program, K splits, warps; the "loop" design described
above or the "split" design) is :data:`CONFIG` (:class:`LaunchConfig`); tools/moe_sweep.py times them.

Tolerance against the reference: float32 within a relative 1e-5 (summation order), bf16 within
2e-2 (tests/test_kernels_cuda.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType as T
from torch import Tensor

from strata_core.experts.ffn import ACTIVATIONS, SILU, ExpertFFN
from strata_core.ops.dequant import fallback_note
from strata_core.ops.gather import _reference as _gather_reference
from strata_core.ops.matmul import matmul
from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES, block_geometry, on_device, table
from strata_core.quant.registry import dequantize_reference

__all__ = ["CONFIG", "MISS_READ", "LaunchConfig", "ffn_args", "moe_decode", "moe_decode_rows", "moe_pair_rows",
           "pair_ffn_reference"]

#: How the CUDA kernel reads a miss from a pinned host arena: "staged" or "direct" (module doc).
MISS_READ = "staged"


@dataclass(frozen=True)
class LaunchConfig:
    """How the CUDA kernels are launched (read on the host at each launch; a sweep sets :data:`CONFIG`).

    ``design``: ``"loop"`` — gate_up programs (pair, BN rows) loop over K; the combining down's programs
    (token, BN rows) loop over the token's pairs; ``"split"`` — gate_up programs (pair, BN rows, K split)
    store float32 partial gate / up products (``split_k`` of them, summed and activated in a fixed order
    where the down launch loads ``h``; ``split_k == 1``: activated in place), and the down programs
    (token, BN rows) decode every pair of the token at once (``[pairs, BN, sub-blocks, SUB]`` tiles),
    combined over the pairs in a fixed order; Q4_K matrices whose bytes are 16-byte aligned are read
    as 16-byte loads of their nibbles (``fast_q4k``); ``"split-loop"`` — the split design's gate_up
    (``split_k`` 1) with the loop design's down launches (the sweep showed the split gate_up ~2x faster
    and the loop's combining down faster for one token). All are deterministic (no atomics).
    ``tile``: values a program decodes per step; ``bn_*``: rows per program of the gate_up, down
    (``moe_pair_rows``) and combining down (``moe_decode``) launches; ``warps_*``: their num_warps.
    Defaults: the sweep's choice on the H200 (tools/moe_sweep.py, BENCHMARKS.md): ``split`` with 8 rows
    a combining program, 110 us a Q4_K layer for one token (loop: 108) and 123 for four (loop: 253).
    """

    design: str = "split"
    tile: int = 4096
    bn_gate_up: int = 8
    bn_down: int = 16
    bn_combine: int = 8
    warps_gate_up: int = 4
    warps_down: int = 4
    warps_combine: int = 4
    split_k: int = 1
    fast_q4k: bool = True

    def __post_init__(self) -> None:
        if self.design not in ("loop", "split", "split-loop"):
            raise ValueError(f"LaunchConfig.design: {self.design!r} is not 'loop', 'split' or 'split-loop'")
        if self.design == "split-loop" and self.split_k != 1:
            raise ValueError("LaunchConfig: the loop design's down launch takes activated h (split_k 1)")
        for name in ("tile", "bn_gate_up", "bn_down", "bn_combine", "warps_gate_up", "warps_down",
                     "warps_combine", "split_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name}: {v} is not a power of two")


#: The launch configuration of the CUDA kernels (tools/moe_sweep.py times alternatives).
CONFIG = LaunchConfig()

#: the optional arguments of both ops: the experts' biases (``[E, F]``, ``[E, F]``, ``[E, H]``, indexed
#: by ``expert[p]``) and the activation (``ACTIVATIONS`` index: 0 silu, 1 swiglu_oai with alpha, limit)
_FFN_ARGS = "Tensor? gate_bias=None, Tensor? up_bias=None, Tensor? down_bias=None, int act=0, " \
            "float alpha=1.702, float limit=7.0"
_SCHEMA = ("(Tensor x, Tensor slots, Tensor arena, Tensor slot, Tensor expert, int topk, int[] qtypes, "
           f"int[] shapes, int[] nbytes, {_FFN_ARGS}) -> Tensor")


def ffn_args(ffn: ExpertFFN) -> dict:
    """The keyword arguments of ``moe_pair_rows`` / ``moe_decode`` that carry ``ffn``."""
    return dict(gate_bias=ffn.gate_bias, up_bias=ffn.up_bias, down_bias=ffn.down_bias,
                act=ACTIVATIONS.index(ffn.activation), alpha=ffn.alpha, limit=ffn.limit)


def _ffn(gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
         act: int = 0, alpha: float = 1.702, limit: float = 7.0) -> ExpertFFN:
    """The ``ExpertFFN`` of the ops' trailing arguments (``_FFN_ARGS``)."""
    return ExpertFFN(ACTIVATIONS[act], gate_bias, up_bias, down_bias, alpha=alpha, limit=limit)


def _pair_linear(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """``x [P, in]`` times pair p's own ``W_p`` (``raw [P, bytes]``, ``shape == (out, in)``) transposed
    -> ``[P, out]``, computed in float32 and returned in ``x.dtype`` like ``quant_matmul``."""
    weight = dequantize_reference(raw, qtype, (raw.shape[0], *shape))  # [P, out, in] float32
    return matmul(x.float()[:, None, :], weight.transpose(1, 2))[:, 0].to(x.dtype)  # [P, out]


def pair_ffn_reference(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: Sequence[int],
                       shapes: Sequence[Sequence[int]], ffn: ExpertFFN = SILU, expert: Tensor | None = None) -> Tensor:
    """Rows ``[P, H]``: pair p's expert (blocks ``gate[p]``, ``up[p]``, ``down[p]``) on ``x[p]`` (``[P, H]``);
    ``ffn`` other than plain SiLU: its activation and the biases of ``expert [P]`` (as ``expert_ffn``)."""
    g = _pair_linear(x, gate, qtypes[0], shapes[0])  # [P, F]
    u = _pair_linear(x, up, qtypes[1], shapes[1])  # [P, F]
    return ffn.post(_pair_linear(ffn.hidden(g, u, expert), down, qtypes[2], shapes[2]), expert)  # [P, H]


def _split(packed: Tensor, nbytes: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    g, u, d = nbytes
    return packed[:, :g], packed[:, g:g + u], packed[:, g + u:g + u + d]


def _shapes(shapes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((shapes[i], shapes[i + 1]) for i in range(0, 6, 2))


def _reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
               qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    """The oracle: gather every pair's packed bytes, then :func:`pair_ffn_reference` (``ffn``: the
    trailing ``_FFN_ARGS``)."""
    packed = _gather_reference(slots, arena.to(slots.device), slot, expert, sum(nbytes))  # [P, total]
    xp = x[torch.arange(slot.shape[0], device=x.device) // topk]  # [P, H]
    return pair_ffn_reference(xp, *_split(packed, nbytes), qtypes, _shapes(shapes), _ffn(*ffn), expert).contiguous()


def _combined(rows: Tensor, weights: Tensor, served: Tensor | None, served_rows: Tensor | None) -> Tensor:
    """``combine_rows`` of ``rows [P, H]`` (a pair flagged in ``served [P]``: its row of ``served_rows``)."""
    from strata_core.experts.rows import combine_rows  # experts import the ops

    if served is not None:
        rows = torch.where(served[:, None], served_rows.to(rows.dtype), rows)
    return combine_rows(rows.view(weights.shape[0], weights.shape[1], -1), weights).contiguous()


def _decode_reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                      topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                      gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                      act: int = 0, alpha: float = 1.702, limit: float = 7.0, served: Tensor | None = None,
                      served_rows: Tensor | None = None) -> Tensor:
    """The oracle of ``moe_decode``: the rows of :func:`_reference` (the ``served`` pairs' taken from
    ``served_rows``), combined by ``combine_rows``."""
    rows = _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, gate_bias, up_bias, down_bias,
                      act, alpha, limit)  # [P, H]
    return _combined(rows, weights, served, served_rows)


def _decode_fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                 topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *args) -> Tensor:
    return x.new_empty((x.shape[0], shapes[4]))


def _rows_reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                    qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    """The oracle of ``moe_decode_rows``: the rows of :func:`_reference` in float32."""
    return _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn).float()


def _rows_fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
               qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    return x.new_empty((slot.shape[0], shapes[4]), dtype=torch.float32)


def _fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
          qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    return x.new_empty((slot.shape[0], shapes[4]))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.gather import _BLOCK as _GATHER_BLOCK, _WORDS, _gather_kernel, gather_experts
    from strata_core.ops.qdecode import _f16, _q4_k_scale_min, decode

    @triton.jit
    def _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR: tl.constexpr):
        """Byte pointer to pair p's packed expert: its slot, else row ``miss[p]`` of the miss source
        (row p itself when ``BY_PAIR``: the staged misses)."""
        s = tl.load(slot_ptr + p).to(tl.int64)
        if BY_PAIR:
            m = p.to(tl.int64)
        else:
            m = tl.load(miss_ptr + p).to(tl.int64)
        addr = tl.where(s >= 0, slots_base + s * slot_stride, miss_base + m * miss_stride)
        return addr.to(tl.pointer_type(tl.uint8))

    @triton.jit
    def _rows_dot(w, row_bytes, rows, xrow, K, tab, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
                  SUB: tl.constexpr, NT: tl.constexpr, BN: tl.constexpr):
        """``[BN]`` float32: rows ``rows`` of the ``[*, K]`` matrix of ``QT`` blocks at ``w`` dotted with
        the K activations at ``xrow``; a step decodes ``[BN, NT, SUB]`` (NT sub-blocks of each row)."""
        NS = BS // SUB
        acc = tl.zeros([BN, NT, SUB], dtype=tl.float32)
        KB = K // BS
        t = tl.arange(0, NT)
        j = t % NS
        wv = tl.arange(0, SUB)
        for kb0 in range(0, KB, NT // NS):
            blk = kb0 + t // NS  # [NT] block of each sub-block of the step
            valid = blk < KB
            blk = tl.where(valid, blk, 0)
            b = w + rows[:, None, None] * row_bytes + blk[None, :, None] * TS  # [BN, NT, 1]
            vals = decode(b, j[None, :, None], wv[None, None, :], tab, QT)  # [BN, NT, SUB]
            xv = tl.load(xrow + blk[:, None] * BS + j[:, None] * SUB + wv[None, :], mask=valid[:, None],
                         other=0.0).to(tl.float32)  # [NT, SUB]
            acc += vals * xv[None, :, :]
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _program_rows(N, BN: tl.constexpr):
        """Program (p, n): pair p, its rows ``[n*BN, (n+1)*BN)`` (clamped into ``[0, N)``) and which to keep."""
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        keep = rows < N
        return tl.program_id(0), tl.where(keep, rows, 0).to(tl.int64), keep

    @triton.jit
    def _bias(b, expert_ptr, p, n, rows, keep):
        """``[BN]`` float32: rows ``rows`` of pair p's expert's row of the ``[E, n]`` bias at ``b``."""
        e = tl.load(expert_ptr + p).to(tl.int64)
        return tl.load(b + e * n + rows, mask=keep, other=0.0).to(tl.float32)

    @triton.jit
    def _act(g, u, OAI: tl.constexpr, ALPHA, LIMIT):
        """``silu(g) * u``, or swiglu_oai (``alpha``, ``limit``) with ``OAI``."""
        if OAI:
            g = tl.minimum(g, LIMIT)
            v = g / (1.0 + tl.exp(-ALPHA * g)) * (tl.minimum(tl.maximum(u, -LIMIT), LIMIT) + 1.0)
        else:
            v = g / (1.0 + tl.exp(-g)) * u
        return v

    @triton.jit
    def _gate_up_kernel(x, h, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                        tab_g, tab_u, N, K, TOPK, UP_OFF, ROW_G, ROW_U, gate_bias, up_bias, expert_ptr, ALPHA, LIMIT,
                        QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr, SUBG: tl.constexpr,
                        NTG: tl.constexpr, QU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr,
                        SUBU: tl.constexpr, NTU: tl.constexpr, BN: tl.constexpr, BY_PAIR: tl.constexpr,
                        BIAS: tl.constexpr, OAI: tl.constexpr):
        """Program (p, n): ``h[p, n*BN:(n+1)*BN] = silu(gate x) * up x`` for pair p (float32); with
        ``BIAS`` the expert's gate and up biases added first, with ``OAI`` swiglu_oai instead of silu."""
        p, rows, keep = _program_rows(N, BN)
        w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
        xrow = x + (p // TOPK).to(tl.int64) * K
        g = _rows_dot(w, ROW_G, rows, xrow, K, tab_g, QG, BSG, TSG, SUBG, NTG, BN)
        u = _rows_dot(w + UP_OFF, ROW_U, rows, xrow, K, tab_u, QU, BSU, TSU, SUBU, NTU, BN)
        if BIAS:
            g += _bias(gate_bias, expert_ptr, p, N, rows, keep)
            u += _bias(up_bias, expert_ptr, p, N, rows, keep)
        tl.store(h + p.to(tl.int64) * N + rows, _act(g, u, OAI, ALPHA, LIMIT), mask=keep)

    @triton.jit
    def _down_kernel(h, out, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                     tab, N, K, DOWN_OFF, ROW, down_bias, expert_ptr, QT: tl.constexpr, BS: tl.constexpr,
                     TS: tl.constexpr, SUB: tl.constexpr, NT: tl.constexpr, BN: tl.constexpr, BY_PAIR: tl.constexpr,
                     BIAS: tl.constexpr):
        """Program (p, n): ``out[p, n*BN:(n+1)*BN] = down h[p]`` (``h`` float32 ``[P, K]``), plus the
        expert's down bias with ``BIAS``."""
        p, rows, keep = _program_rows(N, BN)
        w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
        acc = _rows_dot(w + DOWN_OFF, ROW, rows, h + p.to(tl.int64) * K, K, tab, QT, BS, TS, SUB, NT, BN)
        if BIAS:
            acc += _bias(down_bias, expert_ptr, p, N, rows, keep)
        tl.store(out + p.to(tl.int64) * N + rows, acc.to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _down_combine_kernel(h, out, weights, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                             tab, N, K, DOWN_OFF, ROW, TOPK, down_bias, expert_ptr, served, rows_buf, QT: tl.constexpr,
                             BS: tl.constexpr, TS: tl.constexpr, SUB: tl.constexpr, NT: tl.constexpr,
                             BN: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr, SERVED: tl.constexpr,
                             ROWS_OUT: tl.constexpr):
        """Program (t, n): ``out[t, n*BN:(n+1)*BN] = sum_j weights[t*TOPK + j] * down h[t*TOPK + j]`` (each
        row with its expert's down bias with ``BIAS``); with ``SERVED`` the float32 row of a pair whose
        ``served`` flag is set is ``rows_buf``'s (computed elsewhere); with ``ROWS_OUT`` the rows are
        stored in ``rows_buf`` (float32 ``[P, N]``) instead of combined (``_served``)."""
        t, rows, keep = _program_rows(N, BN)
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in range(TOPK):
            p = t * TOPK + j
            w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
            r = _rows_dot(w + DOWN_OFF, ROW, rows, h + p.to(tl.int64) * K, K, tab, QT, BS, TS, SUB, NT, BN)
            if BIAS:
                r += _bias(down_bias, expert_ptr, p, N, rows, keep)
            at = rows_buf + p.to(tl.int64) * N + rows
            if SERVED:
                r = tl.where(tl.load(served + p) != 0, tl.load(at, mask=keep, other=0.0), r)
            if ROWS_OUT:
                tl.store(at, r, mask=keep)
            else:
                acc += tl.load(weights + p).to(tl.float32) * r
        if not ROWS_OUT:
            tl.store(out + t.to(tl.int64) * N + rows, acc.to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _x_tile(xp, k, mask, HS: tl.constexpr, PK, gbp, ubp, BIAS: tl.constexpr, OAI: tl.constexpr, ALPHA, LIMIT):
        """Float32 activations ``k`` of the rows at ``xp``: the values themselves (``HS == 0``), or ``h``
        from ``HS`` partial gate / up products ``PK`` apart (gates first), summed in split order, the
        biases at ``gbp`` / ``ubp`` added with ``BIAS``, then activated (``_act``)."""
        if HS == 0:
            v = tl.load(xp + k, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(xp + k, mask=mask, other=0.0)
            u = tl.load(xp + HS * PK + k, mask=mask, other=0.0)
            for s in tl.static_range(1, HS):
                g += tl.load(xp + s * PK + k, mask=mask, other=0.0)
                u += tl.load(xp + (HS + s) * PK + k, mask=mask, other=0.0)
            if BIAS:
                g += tl.load(gbp + k, mask=mask, other=0.0).to(tl.float32)
                u += tl.load(ubp + k, mask=mask, other=0.0).to(tl.float32)
            v = tl.where(mask, _act(g, u, OAI, ALPHA, LIMIT), 0.0)
        return v

    @triton.jit
    def _tile_dot(rp, xp, kb_lo, kb_hi, tab, HS: tl.constexpr, PK, gbp, ubp, BIAS: tl.constexpr, OAI: tl.constexpr,
                  ALPHA, LIMIT, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, SUB: tl.constexpr,
                  NT: tl.constexpr, FAST: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
        """``[A, B]`` float32: the rows starting at byte pointers ``rp [A, B, 1, 1]`` (blocks ``kb_lo`` to
        ``kb_hi``) dotted with the activations of ``xp [A or 1, 1, 1, 1]`` (``_x_tile``). A step decodes
        ``[A, B, NT, SUB]`` values; with ``FAST`` (Q4_K, 16-byte aligned rows) ``NT`` 64-value chunks as
        16-byte loads of their 32 bytes of nibbles (low nibbles: sub-block 2c, high: 2c + 1), the
        sub-blocks' mins applied to the sums of their activations."""
        wv = tl.arange(0, SUB)[None, None, None, :]
        if FAST:  # per-(row, chunk) values as [A, B, NT]: a layout without a size-1 dim spreads their loads
            t = tl.arange(0, NT)[None, None, :]
            c = t % 4
            r3 = tl.reshape(rp, [A, B, 1])
            xq = xp + tl.zeros([A, B, 1, 1], dtype=tl.int64)  # x at full shape: its loads take q's layout
            acc = tl.zeros([A, B, NT], dtype=tl.float32)
            for kb0 in range(kb_lo, kb_hi, NT // 4):
                blk = kb0 + t // 4  # [1, 1, NT]
                valid = blk < kb_hi
                blk = tl.where(valid, blk, kb_lo)
                b = r3 + blk * TS  # [A, B, NT]
                qp = tl.max_contiguous(tl.multiple_of((b + 16 + c * 32)[:, :, :, None] + wv, [1, 1, 1, 16]),
                                       [1, 1, 1, 32])
                q = tl.load(qp, mask=valid[:, :, :, None], other=0).to(tl.int32)  # [A, B, NT, 32]
                xo = (blk * BS + c * 64)[:, :, :, None] + wv  # [1, 1, NT, 32]
                xl = _x_tile(xq, xo, valid[:, :, :, None], HS, PK, gbp, ubp, BIAS, OAI, ALPHA, LIMIT)
                xh = _x_tile(xq, xo + 32, valid[:, :, :, None], HS, PK, gbp, ubp, BIAS, OAI, ALPHA, LIMIT)
                sl = tl.sum((q & 15).to(tl.float32) * xl, axis=3)  # [A, B, NT]
                sh = tl.sum((q >> 4).to(tl.float32) * xh, axis=3)
                sc0, mn0 = _q4_k_scale_min(b + 4, 2 * c)
                sc1, mn1 = _q4_k_scale_min(b + 4, 2 * c + 1)
                mins = mn0 * tl.sum(xl, axis=3) + mn1 * tl.sum(xh, axis=3)  # [A, B, NT]
                acc += tl.where(valid, _f16(b) * (sc0 * sl + sc1 * sh) - _f16(b + 2) * mins, 0.0)
            out = tl.sum(acc, axis=2)
        else:
            NS: tl.constexpr = BS // SUB
            t = tl.arange(0, NT)[None, None, :, None]
            acc = tl.zeros([A, B, NT, SUB], dtype=tl.float32)
            j = t % NS
            for kb0 in range(kb_lo, kb_hi, NT // NS):
                blk = kb0 + t // NS  # [1, 1, NT, 1]
                valid = blk < kb_hi
                blk = tl.where(valid, blk, kb_lo)
                vals = decode(rp + blk * TS, j, wv, tab, QT)  # [A, B, NT, SUB]
                xv = _x_tile(xp, blk * BS + j * SUB + wv, valid, HS, PK, gbp, ubp, BIAS, OAI, ALPHA, LIMIT)
                acc += vals * xv
            out = tl.sum(tl.sum(acc, axis=3), axis=2)
        return out

    @triton.jit
    def _gate_up_split_kernel(x, gu, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                              tab_g, tab_u, N, K, KS, PN, TOPK, UP_OFF, ROW_G, ROW_U, gate_bias, up_bias, expert_ptr,
                              ALPHA, LIMIT, QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                              SUBG: tl.constexpr, NTG: tl.constexpr, FASTG: tl.constexpr, QU: tl.constexpr,
                              BSU: tl.constexpr, TSU: tl.constexpr, SUBU: tl.constexpr, NTU: tl.constexpr,
                              FASTU: tl.constexpr, BN: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr,
                              OAI: tl.constexpr, SPLIT: tl.constexpr):
        """Program (p, n, s): pair p's gate and up rows ``[n*BN, (n+1)*BN)`` over the values
        ``[s*KS, (s+1)*KS)``: with ``SPLIT == 1`` ``gu[p, rows] = silu(gate x) * up x`` (``_act``, the
        biases first with ``BIAS``); else the partial products ``gu[s, p, rows]`` and
        ``gu[SPLIT + s, p, rows]`` (``PN`` = pairs x N apart) for the down launch to sum."""
        p, rows, keep = _program_rows(N, BN)
        s = tl.program_id(2)
        w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
        xp = x + (p // TOPK).to(tl.int64) * K
        r4 = rows[None, :, None, None]
        g = _tile_dot(w + r4 * ROW_G, xp, s * (KS // BSG), tl.minimum((s + 1) * (KS // BSG), K // BSG), tab_g,
                      0, 0, x, x, False, False, ALPHA, LIMIT, QG, BSG, TSG, SUBG, NTG, FASTG, 1, BN)
        u = _tile_dot(w + UP_OFF + r4 * ROW_U, xp, s * (KS // BSU), tl.minimum((s + 1) * (KS // BSU), K // BSU),
                      tab_u, 0, 0, x, x, False, False, ALPHA, LIMIT, QU, BSU, TSU, SUBU, NTU, FASTU, 1, BN)
        g = tl.reshape(g, [BN])
        u = tl.reshape(u, [BN])
        out = gu + p.to(tl.int64) * N + rows
        if SPLIT == 1:
            if BIAS:
                g += _bias(gate_bias, expert_ptr, p, N, rows, keep)
                u += _bias(up_bias, expert_ptr, p, N, rows, keep)
            tl.store(out, _act(g, u, OAI, ALPHA, LIMIT), mask=keep)
        else:
            tl.store(out + s * PN, g, mask=keep)
            tl.store(out + (SPLIT + s) * PN, u, mask=keep)

    @triton.jit
    def _down_split_kernel(h, out, weights, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                           tab, N, K, P, PK, DOWN_OFF, ROW, TOPK, gate_bias, up_bias, down_bias, expert_ptr, ALPHA,
                           LIMIT, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, SUB: tl.constexpr,
                           NT: tl.constexpr, FAST: tl.constexpr, J: tl.constexpr, BN: tl.constexpr,
                           BY_PAIR: tl.constexpr, GU_BIAS: tl.constexpr, BIAS: tl.constexpr, OAI: tl.constexpr,
                           HS: tl.constexpr, COMBINE: tl.constexpr, served, rows_buf, SERVED: tl.constexpr,
                           ROWS_OUT: tl.constexpr):
        """Program (g, n): rows ``[n*BN, (n+1)*BN)`` of ``down h`` for J pairs at once: with ``COMBINE``
        token g's pairs ``g*TOPK + j`` (``j < TOPK <= J``), stored as ``out[g, rows] = sum_j weights[p_j] *
        row_j`` summed in pair order; else pairs ``g*J + j`` stored as their rows. ``h``: float32
        ``[P, K]`` (``HS == 0``), or ``HS`` partial gate / up products (``_x_tile``), their biases added
        with ``GU_BIAS``; the down bias with ``BIAS``. ``SERVED`` / ``ROWS_OUT`` (with ``COMBINE``): the
        float32 rows of ``rows_buf`` taken in place of the served pairs' / the rows stored there instead
        of combined, as in ``_down_combine_kernel``."""
        g, rows, keep = _program_rows(N, BN)
        jj = tl.arange(0, J)
        if COMBINE:
            pv = jj < TOPK
            p = g.to(tl.int64) * TOPK + tl.where(pv, jj, 0)
        else:
            p = g.to(tl.int64) * J + jj
            pv = p < P
            p = tl.where(pv, p, 0)
        w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)  # [J]
        e = tl.load(expert_ptr + p).to(tl.int64)[:, None, None, None]
        rp = w[:, None, None, None] + DOWN_OFF + rows[None, :, None, None] * ROW  # [J, BN, 1, 1]
        r = _tile_dot(rp, h + p[:, None, None, None] * K, 0, K // BS, tab, HS, PK, gate_bias + e * K,
                      up_bias + e * K, GU_BIAS, OAI, ALPHA, LIMIT, QT, BS, TS, SUB, NT, FAST, J, BN)  # [J, BN]
        if BIAS:
            r += tl.load(down_bias + tl.reshape(e, [J, 1]) * N + rows[None, :], mask=keep[None, :],
                         other=0.0).to(tl.float32)
        if COMBINE:
            at = rows_buf + p[:, None] * N + rows[None, :]  # [J, BN]
            if SERVED:
                taken = tl.load(served + p, mask=pv, other=0) != 0
                r = tl.where(taken[:, None], tl.load(at, mask=pv[:, None] & keep[None, :], other=0.0), r)
            if ROWS_OUT:
                tl.store(at, r, mask=pv[:, None] & keep[None, :])
            else:
                wt = tl.load(weights + p, mask=pv, other=0.0).to(tl.float32)
                acc = tl.sum(tl.where(pv[:, None], r * wt[:, None], 0.0), axis=0)  # [BN]
                tl.store(out + g.to(tl.int64) * N + rows, acc.to(out.dtype.element_ty), mask=keep)
        else:
            tl.store(out + p[:, None] * N + rows[None, :], r.to(out.dtype.element_ty),
                     mask=pv[:, None] & keep[None, :])

    def _steps(qtype: int, rows: int) -> tuple[int, int, int, int]:
        """(block size, type size, sub-block size, sub-blocks per step) of ``qtype`` for ``rows`` rows a
        program (``CONFIG.tile`` values a step, at least one block)."""
        bs, ts, sub = block_geometry(qtype)
        return bs, ts, sub, max(bs // sub, CONFIG.tile // (rows * sub))

    def _fast_steps(qtype: int, rows: int, offset: int, row_bytes: int, src: tuple) -> tuple[int, int, int, int, bool]:
        """``_steps`` of the split design, and whether the matrix at byte ``offset`` of an expert is read by
        16-byte loads (Q4_K with ``CONFIG.fast_q4k`` and every address 16-byte aligned; then a step is
        ``NT`` 64-value chunks, at least one block)."""
        fast = (CONFIG.fast_q4k and int(qtype) == int(T.Q4_K)
                and all(v % 16 == 0 for v in (offset, row_bytes, *src[2:])))
        if not fast:
            return (*_steps(qtype, rows), False)
        bs, ts, _ = block_geometry(qtype)
        return bs, ts, 32, max(4, CONFIG.tile // (rows * 64)), True

    def _stage_misses(slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, total: int) -> Tensor:
        """``[P, total]`` on the device: missed pairs' experts copied from the arena (resident rows unwritten)."""
        P = slot.shape[0]
        staged = torch.empty((P, total), dtype=torch.uint8, device=slots.device)
        sizes = (total, arena.stride(0), arena.data_ptr())
        word = next(w for w in _WORDS if all(v % w == 0 for v in sizes))
        n_words = total // word
        _gather_kernel[(P, triton.cdiv(n_words, _GATHER_BLOCK))](
            staged.view(_WORDS[word]), slot, expert, 0, 0, arena.data_ptr(), arena.stride(0), n_words,
            BLOCK=_GATHER_BLOCK, SKIP_HITS=True, num_warps=8)
        return staged

    def _moe_any(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                 qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
        """The CUDA kernel (see the module doc); the reference for formats without a decoder."""
        if not all(int(q) in KERNEL_TYPES for q in qtypes):
            fallback_note(next(q for q in qtypes if int(q) not in KERNEL_TYPES), "strata::moe_pair_rows")
            packed = gather_experts(slots, arena, slot, expert, sum(nbytes))  # [P, total] on the device
            xp = x[torch.arange(slot.shape[0], device=x.device) // topk]  # [P, H]
            return pair_ffn_reference(xp, *_split(packed, nbytes), qtypes, _shapes(shapes), _ffn(*ffn),
                                      expert).contiguous()
        with on_device(x.device):  # Triton launches on the current device
            return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, None, _ffn(*ffn))

    def _gate_up(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                 qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                 ffn: ExpertFFN = SILU) -> tuple[Tensor, tuple, bool]:
        """The misses staged (a host arena) and ``silu(gate x) * up x`` of every pair (or ``ffn``'s
        activation of the biased products): float32 ``[P, F]``, the weight sources of the down launch
        and whether they are staged rows."""
        (F_, H), _, _ = _shapes(shapes)
        if (ffn.gate_bias is None) != (ffn.up_bias is None):
            raise ValueError("strata::moe_pair_rows: the kernel takes both gate and up biases or neither")
        P, total = slot.shape[0], sum(nbytes)
        staged = not (arena.device == slots.device or MISS_READ == "direct")
        miss = _stage_misses(slots, arena, slot, expert, total) if staged else arena
        src = (slot, expert, slots.data_ptr(), slots.stride(0), miss.data_ptr(), miss.stride(0))
        gate_up = _gate_up_loop if CONFIG.design == "loop" else _gate_up_split
        return gate_up(x, src, staged, topk, qtypes, F_, H, nbytes, ffn), src, staged

    def _gate_up_loop(x: Tensor, src: tuple, staged: bool, topk: int, qtypes: Sequence[int], F_: int, H: int,
                      nbytes: Sequence[int], ffn: ExpertFFN) -> Tensor:
        """The loop design's gate_up launch (``LaunchConfig``): ``h [P, F]``."""
        h = torch.empty((src[0].shape[0], F_), dtype=torch.float32, device=x.device)  # [P, F]
        bn = CONFIG.bn_gate_up
        (bsg, tsg, subg, ntg), (bsu, tsu, subu, ntu) = (_steps(q, bn) for q in qtypes[:2])
        _gate_up_kernel[(h.shape[0], triton.cdiv(F_, bn))](
            x, h, *src, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, topk,
            nbytes[0], nbytes[0] // F_, nbytes[1] // F_, _or(ffn.gate_bias, h), _or(ffn.up_bias, h), src[1],
            float(ffn.alpha), float(ffn.limit),
            QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, NTG=ntg,
            QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, NTU=ntu, BN=bn, BY_PAIR=staged,
            BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai", num_warps=CONFIG.warps_gate_up)
        return h

    def _gate_up_split(x: Tensor, src: tuple, staged: bool, topk: int, qtypes: Sequence[int], F_: int, H: int,
                       nbytes: Sequence[int], ffn: ExpertFFN) -> Tensor:
        """The split design's gate_up launch: ``h [P, F]`` (``split_k == 1``) or the partial products
        ``[2 * split_k, P, F]`` (gates, then ups)."""
        P, bn, S = src[0].shape[0], CONFIG.bn_gate_up, CONFIG.split_k
        h = torch.empty((P, F_) if S == 1 else (2 * S, P, F_), dtype=torch.float32, device=x.device)
        bsg, tsg, subg, ntg, fastg = _fast_steps(qtypes[0], bn, 0, nbytes[0] // F_, src)
        bsu, tsu, subu, ntu, fastu = _fast_steps(qtypes[1], bn, nbytes[0], nbytes[1] // F_, src)
        unit = max(bsg, bsu)
        ks = triton.cdiv(triton.cdiv(H, S), unit) * unit  # values of a split, whole blocks of both
        _gate_up_split_kernel[(P, triton.cdiv(F_, bn), S)](
            x, h, *src, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, ks, P * F_, topk,
            nbytes[0], nbytes[0] // F_, nbytes[1] // F_, _or(ffn.gate_bias, h), _or(ffn.up_bias, h), src[1],
            float(ffn.alpha), float(ffn.limit),
            QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, NTG=ntg, FASTG=fastg,
            QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, NTU=ntu, FASTU=fastu, BN=bn, BY_PAIR=staged,
            BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai", SPLIT=S,
            num_warps=CONFIG.warps_gate_up)
        return h
    def _or(bias: Tensor | None, dummy: Tensor) -> Tensor:
        """``bias`` made contiguous, or ``dummy`` for a kernel pointer argument that is not read."""
        return dummy if bias is None else bias.to(dummy.device).contiguous()

    def _moe_triton(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                    qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                    weights: Tensor | None = None, ffn: ExpertFFN = SILU, served: Tensor | None = None,
                    served_rows: Tensor | None = None, rows_out: bool = False) -> Tensor:
        """The two Triton launches (and the staging copy of misses in a host arena); the rows
        ``[P, H]``, or with ``weights [T, topk]`` their combination ``[T, H]``; ``ffn``'s biases and
        activation applied in the launches. With ``weights``: ``served [P]`` / ``served_rows [P, H]``
        float32 rows taken in place of the flagged pairs' own, or (``rows_out``) the float32 rows
        ``[P, H]`` the combination would sum, returned instead (``moe_decode_rows``)."""
        slot, expert, x = slot.contiguous(), expert.contiguous(), x.contiguous()
        _, _, (H2, F2) = _shapes(shapes)
        P = slot.shape[0]
        out = (torch.empty((P, H2), dtype=torch.float32, device=x.device) if rows_out else
               torch.empty((P if weights is None else x.shape[0], H2), dtype=x.dtype, device=x.device))
        if P == 0:
            return out.zero_()
        h, src, staged = _gate_up(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, ffn)
        down = (_or(ffn.down_bias, h), expert)
        if rows_out:
            modes = dict(served=h, rows_buf=out, SERVED=False, ROWS_OUT=True)
        elif served is not None:
            modes = dict(served=served.contiguous(), rows_buf=served_rows.contiguous(), SERVED=True, ROWS_OUT=False)
        else:  # the kernels' served-rows arguments, unread
            modes = dict(served=h, rows_buf=h, SERVED=False, ROWS_OUT=False)
        if CONFIG.design == "split":
            _down_split(h, out, weights, src, staged, topk, qtypes, H2, F2, nbytes, ffn, modes)
        elif weights is None:
            bn = CONFIG.bn_down
            bsd, tsd, subd, ntd = _steps(qtypes[2], bn)
            _down_kernel[(P, triton.cdiv(H2, bn))](
                h, out, *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1], nbytes[2] // H2, *down,
                QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=bn, BY_PAIR=staged,
                BIAS=ffn.down_bias is not None, num_warps=CONFIG.warps_down)
        else:
            bn = CONFIG.bn_combine
            bsd, tsd, subd, ntd = _steps(qtypes[2], bn)
            _down_combine_kernel[(x.shape[0], triton.cdiv(H2, bn))](
                h, out, weights.contiguous(), *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1],
                nbytes[2] // H2, topk, *down, modes["served"], modes["rows_buf"],
                QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=bn, BY_PAIR=staged,
                BIAS=ffn.down_bias is not None, SERVED=modes["SERVED"], ROWS_OUT=modes["ROWS_OUT"],
                num_warps=CONFIG.warps_combine)
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
        bn = CONFIG.bn_combine if combine else CONFIG.bn_down
        off = nbytes[0] + nbytes[1]
        bsd, tsd, subd, ntd, fast = _fast_steps(qtypes[2], J * bn, off, nbytes[2] // H2, src)
        programs = weights.shape[0] if combine else P
        _down_split_kernel[(programs, triton.cdiv(H2, bn))](
            h, out, weights.contiguous() if combine else h, *src, table(qtypes[2], h.device), H2, F2, P, P * F2,
            off, nbytes[2] // H2, topk, _or(ffn.gate_bias, h), _or(ffn.up_bias, h), _or(ffn.down_bias, h), src[1],
            float(ffn.alpha), float(ffn.limit),
            QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, FAST=fast, J=J, BN=bn, BY_PAIR=staged,
            GU_BIAS=h.dim() == 3 and ffn.gate_bias is not None, BIAS=ffn.down_bias is not None,
            OAI=ffn.activation == "swiglu_oai", HS=0 if h.dim() == 2 else h.shape[0] // 2, COMBINE=combine,
            **modes, num_warps=CONFIG.warps_combine if combine else CONFIG.warps_down)

    def _decode_any(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                    topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                    gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                    act: int = 0, alpha: float = 1.702, limit: float = 7.0, served: Tensor | None = None,
                    served_rows: Tensor | None = None) -> Tensor:
        """``moe_decode`` on CUDA: the rows combined in the down launch (the ``served`` pairs' rows taken
        from ``served_rows``); the reference's combination of the fallback rows for formats without a
        decoder."""
        ffn = (gate_bias, up_bias, down_bias, act, alpha, limit)
        if not all(int(q) in KERNEL_TYPES for q in qtypes):
            return _combined(_moe_any(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn), weights,
                             served, served_rows)
        with on_device(x.device):
            return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, weights, _ffn(*ffn),
                               None if served is None else served.view(torch.uint8), served_rows)

    def _rows_any(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                  qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
        """``moe_decode_rows`` on CUDA: the combining down launch storing its float32 rows instead of
        summing them (the same arithmetic, row for row); the fallback rows in float32 for formats
        without a decoder."""
        if not all(int(q) in KERNEL_TYPES for q in qtypes):
            return _moe_any(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn).float()
        unread = torch.empty((x.shape[0], topk), dtype=torch.float32, device=x.device)  # the combination's shape
        with on_device(x.device):
            return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, unread, _ffn(*ffn),
                               rows_out=True)


moe_pair_rows = torch.library.custom_op("strata::moe_pair_rows", _reference, mutates_args=(), schema=_SCHEMA)
moe_pair_rows.register_fake(_fake)
if HAS_TRITON:  # opaque like strata::dequantize: the CUDA kernel may fall back to the reference
    moe_pair_rows.register_kernel("cuda")(_moe_any)

moe_decode = torch.library.custom_op(
    "strata::moe_decode", _decode_reference, mutates_args=(),
    schema=("(Tensor x, Tensor slots, Tensor arena, Tensor slot, Tensor expert, Tensor weights, int topk, "
            f"int[] qtypes, int[] shapes, int[] nbytes, {_FFN_ARGS}, Tensor? served=None, "
            "Tensor? served_rows=None) -> Tensor"))
moe_decode.register_fake(_decode_fake)
if HAS_TRITON:
    moe_decode.register_kernel("cuda")(_decode_any)

moe_decode_rows = torch.library.custom_op("strata::moe_decode_rows", _rows_reference, mutates_args=(), schema=_SCHEMA)
moe_decode_rows.register_fake(_rows_fake)
if HAS_TRITON:
    moe_decode_rows.register_kernel("cuda")(_rows_any)
