"""The Triton kernels of the "q8" decode MoE design (launched by :mod:`strata_core.ops.moe_q8`).

Like llama.cpp's vector dot of Q4_K with Q8_1, the activations are quantized to int8 in blocks of 32
values (a float32 scale and the float32 sum of the block's values each), and a Q4_K row is dotted with
them four codes at a time by ``dp4a`` (one instruction: four byte products summed into an int32):
a 32-bit word of a 64-value chunk's nibbles is the four low codes of sub-block 2c (``& 0x0F0F0F0F``)
and the four high codes of sub-block 2c + 1 (``>> 4``), each dp4a-ed with its four int8 activations.
A sub-block's integer sum is scaled once: ``d * scale * xd * sum - dmin * min * xs``. That is about one
instruction per weight where decoding each weight to float32 takes several.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from strata_core.ops.moe_kernels import _act, _bias, _combine_row, _pair_base, _program_rows

__all__ = ["_down_q8_kernel", "_gate_up_q8_kernel", "_quantize_q8_kernel"]

#: bytes of a Q4_K block (256 values): fp16 d, fp16 dmin, 12 bytes of 6-bit scales / mins, 128 of nibbles
Q4_K_BYTES = tl.constexpr(144)


@triton.jit
def _quantize_q8_kernel(x, q, d, s, K, G: tl.constexpr):
    """Program (r, g): blocks ``[g*G, (g+1)*G)`` of 32 values of row r of ``x [R, K]``: ``q [R, K]`` int8
    codes (rounded half away from zero), ``d [R, K/32]`` float32 scales (``max |v| / 127``) and
    ``s [R, K/32]`` the float32 sums of the values themselves."""
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * G + tl.arange(0, G)[:, None]  # [G, 1]
    keep = blk < K // 32
    at = r * K + blk * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
    v = tl.load(x + at, mask=keep, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)  # [G]
    scaled = v * tl.where(amax > 0, 127.0 / amax, 0.0)[:, None]
    codes = tl.where(scaled >= 0, scaled + 0.5, scaled - 0.5).to(tl.int32)  # truncated: half away from zero
    tl.store(q + at, codes.to(tl.int8), mask=keep)
    blk1 = tl.reshape(blk, [G])
    keep1 = blk1 < K // 32
    tl.store(d + r * (K // 32) + blk1, amax / 127.0, mask=keep1)
    tl.store(s + r * (K // 32) + blk1, tl.sum(v, axis=1), mask=keep1)


if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def _dp4a(a, b):
        """The interpreter cannot run PTX: the same sum in integer ops (the kernels' tests run on the CPU)."""
        acc = tl.zeros_like(a)
        for i in tl.static_range(4):
            acc += ((a >> (8 * i)) & 255) * ((b << (24 - 8 * i)) >> 24)  # an unsigned byte times a signed one
        return acc
else:
    @triton.jit
    def _dp4a(a, b):
        """Elementwise int32: the four unsigned bytes of ``a`` times the four signed bytes of ``b``, summed."""
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _scale_min(s0, s1, s2, j):
    """6-bit scale and min of sub-block ``j`` from a Q4_K block's 12 scale bytes as three int32 words."""
    shift = (j % 4) * 8
    b0 = (s0 >> shift) & 255
    b1 = (s1 >> shift) & 255
    b2 = (s2 >> shift) & 255
    low = j < 4
    sc = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _half(bits):
    """The fp16 in the low 16 bits of int32 ``bits`` as float32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k_rows_q8(rows, xw, xd, xs, KB, BN: tl.constexpr, BK: tl.constexpr):
    """``[BN]`` float32: the Q4_K rows starting at byte pointers ``rows [BN]`` (``KB`` blocks each, every
    address 16-byte aligned) dotted with one row of q8 activations (``xw``: its int32 words, ``xd`` /
    ``xs``: its scales and sums per 32 values); a step reads ``BK`` blocks of every row. Each word's two
    dp4a sums are scaled and accumulated where they are (a sub-block's scale broadcast over its words),
    so the only sums across threads are the final ones."""
    kb = tl.arange(0, BK)[None, :, None]  # [1, BK, 1]
    c = tl.arange(0, 4)[None, None, :]  # [1, 1, 4]: the 64-value chunks of a block
    i = tl.arange(0, 8)[None, None, None, :]  # [1, 1, 1, 8]: the words of a chunk
    r3 = rows[:, None, None]
    zero = tl.zeros([BN, 1, 1, 1], dtype=tl.int32)
    acc = tl.zeros([BN, BK, 4, 8], dtype=tl.float32)
    mins = tl.zeros([BN, BK, 4], dtype=tl.float32)
    for k0 in range(0, KB, BK):
        blk = k0 + kb
        valid = blk < KB
        blk = tl.where(valid, blk, 0)
        hdr = (r3 + blk * Q4_K_BYTES).to(tl.pointer_type(tl.int32))  # [BN, BK, 1]
        wp = tl.max_contiguous(tl.multiple_of(hdr[:, :, :, None] + 4 + c[:, :, :, None] * 8 + i, [1, 1, 1, 16]),
                               [1, 1, 1, 8])
        words = tl.load(wp)  # [BN, BK, 4, 8]
        dd = tl.load(hdr)
        s0, s1, s2 = tl.load(hdr + 1), tl.load(hdr + 2), tl.load(hdr + 3)
        xo = tl.max_contiguous(tl.multiple_of((blk * 64 + c * 16)[:, :, :, None] + i + zero, [1, 1, 1, 8]),
                               [1, 1, 1, 8])  # at the words' full shape: the loads take their layout
        xl = tl.load(xw + xo, mask=valid[:, :, :, None], other=0)  # [1, BK, 4, 8]: the words of sub-block 2c
        xh = tl.load(xw + xo + 8, mask=valid[:, :, :, None], other=0)  # and of 2c + 1
        sb = blk * 8 + 2 * c  # [1, BK, 4]: sub-block 2c's index in the row
        scl, mnl = _scale_min(s0, s1, s2, 2 * c)
        sch, mnh = _scale_min(s0, s1, s2, 2 * c + 1)
        d = _half(dd)
        fl = d * scl * tl.load(xd + sb, mask=valid, other=0.0)  # [BN, BK, 4]
        fh = d * sch * tl.load(xd + sb + 1, mask=valid, other=0.0)
        acc += (fl[:, :, :, None] * _dp4a(words & 0x0F0F0F0F, xl).to(tl.float32)
                + fh[:, :, :, None] * _dp4a((words >> 4) & 0x0F0F0F0F, xh).to(tl.float32))
        mins += _half(dd >> 16) * (mnl * tl.load(xs + sb, mask=valid, other=0.0)
                                   + mnh * tl.load(xs + sb + 1, mask=valid, other=0.0))
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1) - tl.sum(tl.sum(mins, axis=2), axis=1)


@triton.jit
def _gate_up_q8_kernel(xw, xd, xs, h, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, N, K,
                       TOPK, UP_OFF, ROW_G, ROW_U, gate_bias, up_bias, expert_ptr, ALPHA, LIMIT, BN: tl.constexpr,
                       BK: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr, OAI: tl.constexpr):
    """Program (p, n): ``h[p, n*BN:(n+1)*BN] = act(gate x, up x)`` (float32; ``_act``, the biases first
    with ``BIAS``) for pair p, on its token's q8 activations (``xw [T, K/4]`` int32 words, ``xd`` /
    ``xs [T, K/32]``)."""
    p, rows, keep = _program_rows(N, BN)
    w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
    t = (p // TOPK).to(tl.int64)
    xwt, xdt, xst = xw + t * (K // 4), xd + t * (K // 32), xs + t * (K // 32)
    g = _q4_k_rows_q8(w + rows * ROW_G, xwt, xdt, xst, K // 256, BN, BK)
    u = _q4_k_rows_q8(w + UP_OFF + rows * ROW_U, xwt, xdt, xst, K // 256, BN, BK)
    if BIAS:
        g += _bias(gate_bias, expert_ptr, p, N, rows, keep)
        u += _bias(up_bias, expert_ptr, p, N, rows, keep)
    tl.store(h + p.to(tl.int64) * N + rows, _act(g, u, OAI, ALPHA, LIMIT), mask=keep)


@triton.jit
def _down_q8_kernel(hw, hd, hs, out, weights, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride,
                    N, K, DOWN_OFF, ROW, PAIRS, down_bias, expert_ptr, served, rows_buf, BN: tl.constexpr,
                    BK: tl.constexpr, BY_PAIR: tl.constexpr, BIAS: tl.constexpr, COMBINE: tl.constexpr,
                    SERVED: tl.constexpr, ROWS_OUT: tl.constexpr):
    """Program (g, n): rows ``[n*BN, (n+1)*BN)`` of ``down h`` for the pairs ``g*PAIRS + j`` (on their
    q8 ``h``: ``hw [P, K/4]``, ``hd`` / ``hs [P, K/32]``), each with its expert's down bias with
    ``BIAS``. With ``COMBINE`` (``PAIRS`` = top-k): ``out[g, rows] = sum_j weights[p_j] * row_j`` summed
    in pair order (``SERVED``: a flagged pair's float32 row taken from ``rows_buf``; ``ROWS_OUT``: the
    rows stored in ``rows_buf`` instead of combined); else (``PAIRS`` 1) pair g's row stored at
    ``out[g]``."""
    g, rows, keep = _program_rows(N, BN)
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in range(PAIRS):
        p = g.to(tl.int64) * PAIRS + j
        w = _pair_base(p, slot_ptr, miss_ptr, slots_base, slot_stride, miss_base, miss_stride, BY_PAIR)
        r = _q4_k_rows_q8(w + DOWN_OFF + rows * ROW, hw + p * (K // 4), hd + p * (K // 32), hs + p * (K // 32),
                          K // 256, BN, BK)
        if BIAS:
            r += _bias(down_bias, expert_ptr, p, N, rows, keep)
        if COMBINE:
            acc = _combine_row(acc, r, p, N, rows, keep, weights, served, rows_buf, SERVED, ROWS_OUT)
        else:
            tl.store(out + p * N + rows, r.to(out.dtype.element_ty), mask=keep)
    if COMBINE and not ROWS_OUT:
        tl.store(out + g.to(tl.int64) * N + rows, acc.to(out.dtype.element_ty), mask=keep)
