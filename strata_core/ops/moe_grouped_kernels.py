"""The Triton kernels of the grouped decode MoE design (launched by :mod:`strata_core.ops.moe_grouped`).

``_align_kernel`` sorts a window's (token, expert) pairs by expert on the device and pads each
expert's run to whole blocks of ``BM`` rows; ``_grouped_gate_up_kernel`` and ``_grouped_down_kernel``
give each program one block (one expert) and ``BN`` output rows: it decodes a ``[BN, KT]`` tile of
the expert's weights once per K step (:func:`strata_core.ops.qdecode.decode`) and multiplies it with
the ``[BM, KT]`` activations of all the block's pairs (``tl.dot``, float32 accumulation; Q4_K with
16-byte aligned rows: each 64-value chunk's 32 bytes of nibbles as 16-byte loads, two products of 32);
``_combine_pairs_kernel`` sums each token's rows in pair order. Weights are found as the single-pair
kernels find them (``_pair_base``): the pairs of one block share their expert, so its first pair's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata_core.ops.moe_kernels import _act, _bias, _pair_base
from strata_core.ops.qdecode import _f16, _q4_k_scale_min, decode

__all__ = ["_align_kernel", "_combine_pairs_kernel", "_grouped_down_kernel", "_grouped_gate_up_kernel"]


@triton.jit
def _align_kernel(expert_ptr, sorted_ptr, total_ptr, P, BM: tl.constexpr, PB: tl.constexpr, QC: tl.constexpr):
    """One program over the ``P <= PB`` pairs: ``sorted[r]`` is the pair of row r, the pairs sorted by
    expert (ascending, in pair order within an expert), each expert's run starting at a multiple of
    ``BM`` and padded with ``P`` to one; ``total[0]``: the rows in use (rows past it are not written).
    Pairs are compared ``QC`` at a time against all (no bins: expert ids of any range)."""
    p = tl.arange(0, PB)
    keep = p < P
    e = tl.load(expert_ptr + p, mask=keep, other=0).to(tl.int64)
    count = tl.zeros([PB], dtype=tl.int32)  # pairs of p's expert
    before = tl.zeros([PB], dtype=tl.int32)  # pairs q < p of p's expert
    start = tl.zeros([PB], dtype=tl.int32)  # the first row of p's expert: the padded runs of lower experts
    for q0 in range(0, P, QC):
        q = q0 + tl.arange(0, QC)
        qv = q < P
        eq = tl.load(expert_ptr + q, mask=qv, other=0).to(tl.int64)
        same = ((e[:, None] == eq[None, :]) & keep[:, None] & qv[None, :]).to(tl.int32)  # [PB, QC]
        count += tl.sum(same, axis=1)
        before += tl.sum(tl.where(q[None, :] < p[:, None], same, 0), axis=1)
        q_first = qv & (tl.sum(tl.where(p[:, None] < q[None, :], same, 0), axis=0) == 0)  # [QC]
        q_rows = tl.where(q_first, (tl.sum(same, axis=0) + BM - 1) // BM * BM, 0)  # [QC]: q's run, at its first pair
        start += tl.sum(tl.where(eq[None, :] < e[:, None], q_rows[None, :], 0), axis=1)
    tl.store(sorted_ptr + start + before, p, mask=keep)
    first = keep & (before == 0)
    padded = (count + BM - 1) // BM * BM
    i = tl.arange(0, BM)[None, :]
    pad = count[:, None] + i  # [PB, BM]: the padding rows of each run, written at its first pair
    tl.store(sorted_ptr + start[:, None] + pad, tl.zeros([PB, BM], dtype=tl.int32) + P,
             mask=first[:, None] & (pad < padded[:, None]))
    tl.store(total_ptr, tl.sum(tl.where(first, padded, 0), axis=0))


@triton.jit
def _block(b, sorted_ptr, P, N, BM: tl.constexpr, BN: tl.constexpr):
    """Program (b, n)'s block b (in use): its rows ``[BM]``, their pairs, which are real, its first
    pair (real: every run starts a block), and its output rows ``[BN]`` (clamped into ``[0, N)``) with
    which to keep."""
    rows = b * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    keep = cols < N
    return (rows.to(tl.int64), pair, pair < P, tl.load(sorted_ptr + b * BM), tl.where(keep, cols, 0).to(tl.int64),
            keep)


@triton.jit
def _tile(w, cols, row_bytes, k0, K, tab, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
          SUB: tl.constexpr, BN: tl.constexpr, KT: tl.constexpr):
    """``[BN, KT]`` float32: values ``[k0, k0 + KT)`` of rows ``cols`` of the ``[*, K]`` matrix of ``QT``
    blocks at byte pointer ``w``; sub-blocks past K decode the row's first (their activations are zero)."""
    NS: tl.constexpr = KT // SUB
    s = k0 // SUB + tl.arange(0, NS)  # [NS] sub-blocks of the step
    s = tl.where(s < K // SUB, s, 0)
    b = w + cols[:, None, None] * row_bytes + (s // (BS // SUB))[None, :, None] * TS  # [BN, NS, 1]
    vals = decode(b, (s % (BS // SUB))[None, :, None], tl.arange(0, SUB)[None, None, :], tab, QT)  # [BN, NS, SUB]
    return tl.reshape(vals, [BN, KT])


@triton.jit
def _dot(a, w, acc, PREC: tl.constexpr):
    """``acc + a @ w.T`` (``a [BM, KT]``, ``w [BN, KT]`` float32, ``acc [BM, BN]`` float32): ``PREC`` is
    ``tl.dot``'s input precision, or ``"bf16"``: both operands rounded to bf16."""
    if PREC == "bf16":
        out = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    else:
        out = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
    return out


@triton.jit
def _q4_k_chunk(w, cols, row_bytes, kc, K, BS: tl.constexpr, TS: tl.constexpr):
    """The 64-value chunk at ``kc`` of rows ``cols`` of a Q4_K matrix with 16-byte aligned rows at ``w``: its 32
    bytes of nibbles ``[BN, 32]`` uint8 (16-byte loads; low nibbles sub-block 2c, high 2c + 1), and ``[BN]`` each
    of ``d * scale`` and ``dmin * min`` of the two sub-blocks (a chunk past K reads the row's last block)."""
    b = w + cols * row_bytes + tl.minimum(kc // BS, K // BS - 1) * TS  # [BN]: its block
    c = (kc % BS) // 64
    qp = tl.max_contiguous(tl.multiple_of((b + 16 + c * 32)[:, None] + tl.arange(0, 32)[None, :], [1, 16]), [1, 32])
    sc0, mn0 = _q4_k_scale_min(b + 4, 2 * c)
    sc1, mn1 = _q4_k_scale_min(b + 4, 2 * c + 1)
    d, dmin = _f16(b), _f16(b + 2)
    return tl.load(qp), d * sc0, dmin * mn0, d * sc1, dmin * mn1


@triton.jit
def _step(acc, arow, real, w, cols, row_bytes, k0, K, tab, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
          SUB: tl.constexpr, FAST: tl.constexpr, BN: tl.constexpr, KT: tl.constexpr, PREC: tl.constexpr):
    """``acc [BM, BN]`` plus values ``[k0, k0 + KT)`` of the activations at ``arow [BM, 1]`` (a row not
    ``real``, or a value past K: zero) times those of rows ``cols`` of the ``[*, K]`` matrix of ``QT``
    blocks at ``w``. ``FAST`` (Q4_K, every row 16-byte aligned): per 64-value chunk, its 32 bytes of
    nibbles as 16-byte loads, the low nibbles (sub-block 2c) and the high (2c + 1) each a product of 32."""
    if FAST:
        wv = tl.arange(0, 32)[None, :]
        for ci in tl.static_range(KT // 64):
            kc = k0 + ci * 64
            q, s0, m0, s1, m1 = _q4_k_chunk(w, cols, row_bytes, kc, K, BS, TS)
            q = q.to(tl.int32)
            mask = real[:, None] & (kc + wv < K)  # [BM, 32]
            lo = tl.load(arow + kc + wv, mask=mask, other=0.0).to(tl.float32)  # [BM, 32]
            hi = tl.load(arow + kc + 32 + wv, mask=mask, other=0.0).to(tl.float32)
            acc = _dot(lo, s0[:, None] * (q & 15).to(tl.float32) - m0[:, None], acc, PREC)
            acc = _dot(hi, s1[:, None] * (q >> 4).to(tl.float32) - m1[:, None], acc, PREC)
    else:
        kk = tl.arange(0, KT)[None, :]
        a = tl.load(arow + k0 + kk, mask=real[:, None] & (k0 + kk < K), other=0.0).to(tl.float32)  # [BM, KT]
        acc = _dot(a, _tile(w, cols, row_bytes, k0, K, tab, QT, BS, TS, SUB, BN, KT), acc, PREC)
    return acc


@triton.jit
def _grouped_gate_up_kernel(x, h, sorted_ptr, total_ptr, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base,
                            miss_stride, tab_g, tab_u, N, K, P, TOPK, UP_OFF, ROW_G, ROW_U, gate_bias, up_bias,
                            expert_ptr, ALPHA, LIMIT, QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                            SUBG: tl.constexpr, FASTG: tl.constexpr, QU: tl.constexpr, BSU: tl.constexpr,
                            TSU: tl.constexpr, SUBU: tl.constexpr, FASTU: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, KT: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr,
                            OAI: tl.constexpr, PREC: tl.constexpr):
    """Program (b, n): ``h[row, cols] = act(gate x, up x)`` (float32; ``_act``, the biases first with
    ``BIAS``) for the ``BM`` rows of block b (one expert's pairs, token ``pair // TOPK``; a padding row's
    activations are zero) and the gate / up rows ``cols = [n*BN, (n+1)*BN)``; a block past the rows in
    use exits."""
    b = tl.program_id(0)
    if b * BM < tl.load(total_ptr):
        rows, pair, real, p0, cols, keep = _block(b, sorted_ptr, P, N, BM, BN)
        w = _pair_base(p0, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
        xrow = x + (tl.where(real, pair, 0) // TOPK).to(tl.int64)[:, None] * K  # [BM, 1]
        g = tl.zeros([BM, BN], dtype=tl.float32)
        u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, KT):
            g = _step(g, xrow, real, w, cols, ROW_G, k0, K, tab_g, QG, BSG, TSG, SUBG, FASTG, BN, KT, PREC)
            u = _step(u, xrow, real, w + UP_OFF, cols, ROW_U, k0, K, tab_u, QU, BSU, TSU, SUBU, FASTU, BN, KT, PREC)
        if BIAS:
            g += _bias(gate_bias, expert_ptr, p0, N, cols, keep)[None, :]
            u += _bias(up_bias, expert_ptr, p0, N, cols, keep)[None, :]
        tl.store(h + rows[:, None] * N + cols[None, :], _act(g, u, OAI, ALPHA, LIMIT), mask=keep[None, :])


@triton.jit
def _grouped_down_kernel(h, out, sorted_ptr, total_ptr, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base,
                         miss_stride, tab, N, K, P, DOWN_OFF, ROW, down_bias, expert_ptr, served, served_rows,
                         QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, SUB: tl.constexpr,
                         FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KT: tl.constexpr,
                         BY_PAIR: tl.constexpr, BIAS: tl.constexpr, SERVED: tl.constexpr, PREC: tl.constexpr):
    """Program (b, n): ``out[pair, cols] = down h[row]`` (plus the down bias with ``BIAS``) for the real
    rows of block b (``h`` float32 ``[rows, K]`` in block order) and ``cols = [n*BN, (n+1)*BN)``, stored
    by pair; with ``SERVED`` a pair whose ``served`` flag is set stores its float32 row of
    ``served_rows`` (computed elsewhere) instead."""
    b = tl.program_id(0)
    if b * BM < tl.load(total_ptr):
        rows, pair, real, p0, cols, keep = _block(b, sorted_ptr, P, N, BM, BN)
        w = _pair_base(p0, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR) + DOWN_OFF
        hrow = h + rows[:, None] * K  # [BM, 1]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, KT):
            acc = _step(acc, hrow, real, w, cols, ROW, k0, K, tab, QT, BS, TS, SUB, FAST, BN, KT, PREC)
        if BIAS:
            acc += _bias(down_bias, expert_ptr, p0, N, cols, keep)[None, :]
        at = tl.where(real, pair, 0).to(tl.int64)[:, None] * N + cols[None, :]  # [BM, BN]
        mask = real[:, None] & keep[None, :]
        if SERVED:
            taken = tl.load(served + pair, mask=real, other=0) != 0
            acc = tl.where(taken[:, None], tl.load(served_rows + at, mask=mask, other=0.0), acc)
        tl.store(out + at, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _combine_pairs_kernel(rows, weights, out, N, TOPK, BN: tl.constexpr):
    """Program (t, n): ``out[t, cols] = sum_j weights[t*TOPK + j] * rows[t*TOPK + j, cols]`` over float32
    rows, summed in float32 in pair order (j = 0, 1, ...)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    keep = cols < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in range(TOPK):
        p = t * TOPK + j
        acc += tl.load(weights + p).to(tl.float32) * tl.load(rows + p * N + cols, mask=keep, other=0.0)
    tl.store(out + t * N + cols, acc.to(out.dtype.element_ty), mask=keep)
