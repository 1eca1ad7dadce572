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

Tolerance against the reference: float32 within a relative 1e-5 (summation order), bf16 within
2e-2 (tests/test_kernels_cuda.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.experts.ffn import ACTIVATIONS, SILU, ExpertFFN
from strata_core.ops.dequant import fallback_note
from strata_core.ops.gather import _reference as _gather_reference
from strata_core.ops.matmul import matmul
from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES, block_geometry, on_device, table
from strata_core.quant.registry import dequantize_reference

__all__ = ["MISS_READ", "ffn_args", "moe_decode", "moe_pair_rows", "pair_ffn_reference"]

#: How the CUDA kernel reads a miss from a pinned host arena: "staged" or "direct" (module doc).
MISS_READ = "staged"

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


def _decode_reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                      topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    """The oracle of ``moe_decode``: the rows of :func:`_reference`, combined by ``combine_rows``."""
    from strata_core.experts.rows import combine_rows  # experts import the ops

    rows = _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn)  # [P, H]
    return combine_rows(rows.view(x.shape[0], topk, -1), weights).contiguous()


def _decode_fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                 topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    return x.new_empty((x.shape[0], shapes[4]))


def _fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
          qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
    return x.new_empty((slot.shape[0], shapes[4]))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.gather import _BLOCK as _GATHER_BLOCK, _WORDS, _gather_kernel, gather_experts
    from strata_core.ops.qdecode import decode

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
        if OAI:
            g = tl.minimum(g, LIMIT)
            out = g / (1.0 + tl.exp(-ALPHA * g)) * (tl.minimum(tl.maximum(u, -LIMIT), LIMIT) + 1.0)
        else:
            out = g / (1.0 + tl.exp(-g)) * u
        tl.store(h + p.to(tl.int64) * N + rows, out, mask=keep)

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
                             tab, N, K, DOWN_OFF, ROW, TOPK, down_bias, expert_ptr, QT: tl.constexpr,
                             BS: tl.constexpr, TS: tl.constexpr, SUB: tl.constexpr, NT: tl.constexpr,
                             BN: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr):
        """Program (t, n): ``out[t, n*BN:(n+1)*BN] = sum_j weights[t*TOPK + j] * down h[t*TOPK + j]`` (each
        row with its expert's down bias with ``BIAS``)."""
        t, rows, keep = _program_rows(N, BN)
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in range(TOPK):
            p = t * TOPK + j
            w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
            r = _rows_dot(w + DOWN_OFF, ROW, rows, h + p.to(tl.int64) * K, K, tab, QT, BS, TS, SUB, NT, BN)
            if BIAS:
                r += _bias(down_bias, expert_ptr, p, N, rows, keep)
            acc += tl.load(weights + p).to(tl.float32) * r
        tl.store(out + t.to(tl.int64) * N + rows, acc.to(out.dtype.element_ty), mask=keep)

    #: Values a program decodes per step (rows x sub-blocks x sub-block size); rows per program.
    #: (rows per program of gate_up, of down, of the combining down: its grid is 8x smaller for top-8,
    #: hence fewer rows a program to keep the SMs busy; measured on the H200, BENCHMARKS.md)
    _TILE, _BN_GATE_UP, _BN, _BN_COMBINE = 4096, 8, 16, 4

    def _steps(qtype: int, bn: int = _BN) -> tuple[int, int, int, int]:
        """(block size, type size, sub-block size, sub-blocks per step) of ``qtype`` for ``bn`` rows a program."""
        bs, ts, sub = block_geometry(qtype)
        return bs, ts, sub, max(bs // sub, _TILE // (bn * sub))

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
        h = torch.empty((P, F_), dtype=torch.float32, device=x.device)  # [P, F]
        (bsg, tsg, subg, ntg), (bsu, tsu, subu, ntu) = (_steps(q, _BN_GATE_UP) for q in qtypes[:2])
        _gate_up_kernel[(P, triton.cdiv(F_, _BN_GATE_UP))](
            x, h, *src, table(qtypes[0], x.device), table(qtypes[1], x.device), F_, H, topk,
            nbytes[0], nbytes[0] // F_, nbytes[1] // F_, _or(ffn.gate_bias, h), _or(ffn.up_bias, h), expert,
            float(ffn.alpha), float(ffn.limit),
            QG=int(qtypes[0]), BSG=bsg, TSG=tsg, SUBG=subg, NTG=ntg,
            QU=int(qtypes[1]), BSU=bsu, TSU=tsu, SUBU=subu, NTU=ntu, BN=_BN_GATE_UP, BY_PAIR=staged,
            BIAS=ffn.gate_bias is not None, OAI=ffn.activation == "swiglu_oai", num_warps=4)
        return h, src, staged

    def _or(bias: Tensor | None, dummy: Tensor) -> Tensor:
        """``bias`` made contiguous, or ``dummy`` for a kernel pointer argument that is not read."""
        return dummy if bias is None else bias.to(dummy.device).contiguous()

    def _moe_triton(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                    qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                    weights: Tensor | None = None, ffn: ExpertFFN = SILU) -> Tensor:
        """The two Triton launches (and the staging copy of misses in a host arena); the rows
        ``[P, H]``, or with ``weights [T, topk]`` their combination ``[T, H]``; ``ffn``'s biases and
        activation applied in the launches."""
        slot, expert, x = slot.contiguous(), expert.contiguous(), x.contiguous()
        _, _, (H2, F2) = _shapes(shapes)
        P = slot.shape[0]
        out = torch.empty((P if weights is None else x.shape[0], H2), dtype=x.dtype, device=x.device)
        if P == 0:
            return out.zero_()
        h, src, staged = _gate_up(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, ffn)
        down = (_or(ffn.down_bias, h), expert)
        if weights is None:
            bsd, tsd, subd, ntd = _steps(qtypes[2])
            _down_kernel[(P, triton.cdiv(H2, _BN))](
                h, out, *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1], nbytes[2] // H2, *down,
                QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=_BN, BY_PAIR=staged,
                BIAS=ffn.down_bias is not None, num_warps=4)
        else:
            bsd, tsd, subd, ntd = _steps(qtypes[2], _BN_COMBINE)
            _down_combine_kernel[(x.shape[0], triton.cdiv(H2, _BN_COMBINE))](
                h, out, weights.contiguous(), *src, table(qtypes[2], x.device), H2, F2, nbytes[0] + nbytes[1],
                nbytes[2] // H2, topk, *down,
                QT=int(qtypes[2]), BS=bsd, TS=tsd, SUB=subd, NT=ntd, BN=_BN_COMBINE, BY_PAIR=staged,
                BIAS=ffn.down_bias is not None, num_warps=4)
        return out

    def _decode_any(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                    topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn) -> Tensor:
        """``moe_decode`` on CUDA: the rows combined in the down launch; the reference's combination of
        the fallback rows for formats without a decoder."""
        if not all(int(q) in KERNEL_TYPES for q in qtypes):
            from strata_core.experts.rows import combine_rows

            rows = _moe_any(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn)
            return combine_rows(rows.view(x.shape[0], topk, -1), weights).contiguous()
        with on_device(x.device):
            return _moe_triton(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, weights, _ffn(*ffn))


moe_pair_rows = torch.library.custom_op("strata::moe_pair_rows", _reference, mutates_args=(), schema=_SCHEMA)
moe_pair_rows.register_fake(_fake)
if HAS_TRITON:  # opaque like strata::dequantize: the CUDA kernel may fall back to the reference
    moe_pair_rows.register_kernel("cuda")(_moe_any)

moe_decode = torch.library.custom_op(
    "strata::moe_decode", _decode_reference, mutates_args=(),
    schema=("(Tensor x, Tensor slots, Tensor arena, Tensor slot, Tensor expert, Tensor weights, int topk, "
            f"int[] qtypes, int[] shapes, int[] nbytes, {_FFN_ARGS}) -> Tensor"))
moe_decode.register_fake(_decode_fake)
if HAS_TRITON:
    moe_decode.register_kernel("cuda")(_decode_any)
