"""The Triton kernels of :mod:`strata_core.ops.moe` and their building blocks; how they are launched
is :mod:`strata_core.ops.moe_triton`.

The "loop" design: ``_gate_up_kernel`` (program: a pair's BN rows of gate and up, looping over K),
``_down_kernel`` / ``_down_combine_kernel`` (a pair's, or a token's pairs', BN rows of down). The
"split" design: ``_gate_up_split_kernel`` (a pair's BN rows over one K split, Q4_K as 16-byte loads)
and ``_down_split_kernel`` (a token's pairs decoded at once, combined in pair order). Weights are
found on the device (``_pair_base``: a cache slot, or the staged / pinned copy of a miss) and decoded
in registers with :mod:`strata_core.ops.qdecode`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata_core.ops.qdecode import _f16, _q4_k_scale_min, decode

__all__ = ["_gate_up_kernel", "_down_kernel", "_down_combine_kernel", "_gate_up_split_kernel", "_down_split_kernel"]


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
def _combine_row(acc, r, p, N, rows, keep, weights, served, rows_buf, SERVED: tl.constexpr, ROWS_OUT: tl.constexpr):
    """``acc`` plus pair p's weight times its row ``r`` (``rows`` of N): with ``SERVED`` the float32 row of
    ``rows_buf`` in place of ``r`` where p's ``served`` flag is set; with ``ROWS_OUT`` the row stored in
    ``rows_buf`` instead (``acc`` as it was)."""
    at = rows_buf + p * N + rows
    if SERVED:
        r = tl.where(tl.load(served + p) != 0, tl.load(at, mask=keep, other=0.0), r)
    if ROWS_OUT:
        tl.store(at, r, mask=keep)
    else:
        acc += tl.load(weights + p).to(tl.float32) * r
    return acc

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
        acc = _combine_row(acc, r, p.to(tl.int64), N, rows, keep, weights, served, rows_buf, SERVED, ROWS_OUT)
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
