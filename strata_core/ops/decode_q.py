"""The fused decode step's KV ops over a quantized paged KV (``--kv-type q8_0|int8|fp8``, model/kvquant.py).

The same contract as ``strata::rope_kv_write`` and ``strata::decode_attention`` (ops/decode.py), with
each pool beside its scales: ``key_pool`` / ``value_pool`` hold the codes ``[n_blocks, block_size,
n_kv_heads, D]`` (int8, or fp8 e4m3's bytes as uint8) and ``key_scales`` / ``value_scales`` the scales
``[n_blocks, block_size, n_kv_heads, G]`` (G groups of ``D / G`` values a row: float16 for q8_0,
float32 for int8 and fp8):

- ``rope_kv_write_q(qkv, positions, q_norm, k_norm, theta, eps, n_heads, n_kv_heads, key_pool,
  value_pool, key_scales, value_scales, block_table, table, inv_freq=None, mscale=1.0) -> q [B, n_heads, D]``: as
  ``rope_kv_write``, the k and v rows (rounded to the compute dtype first, as the eager path's are)
  quantized as ``kvquant.quantize`` does before they are stored;
- ``decode_attention_q(q, positions, key_pool, value_pool, key_scales, value_scales, block_table, table,
  splits=0) -> [B, n_heads * D]``: as ``decode_attention`` over ``kvquant.dequantize``'s rows, with the
  scales applied after the products instead of to each value: a tile's codes (exact in bf16) meet q in
  the dot, and each key's scale (each group's, for q8_0) multiplies its scores, and for the values joins
  its probabilities; no dequantized copy of the cache exists.

``table`` (int64 ``[B, 5]``: key codes, value codes, session b's block table, key scales, value scales
addresses; ``kv_table_q``) is how the CUDA kernels reach them, as in ops/decode.py. The CPU kernels are
the references; the Triton kernels run on CUDA and under ``TRITON_INTERPRET=1`` on CPU tensors
(tests/test_kv_quant.py). q8_0 and int8 codes are exact against the reference (IEEE divisions);
the attention within float rounding (the scales applied after the sums round otherwise than before them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.model.kvquant import FP8, dequantize, quantize
from strata_core.ops.decode import (_attention_splits, _need_blocks, _paged_rows, _rms, _split_heads,
                                    apply_rope, rope_cos_sin)
from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["decode_attention_q", "fused_quantized_supported", "kv_table_q", "rope_kv_write_q"]

#: The CUDA decode attention's positions a tile, pipeline stages of its key loop, warps a program and most
#: splits of a (session, kv head) (``_attention_splits``' rule up to it): on the H200 at 32K of context and
#: one session the fastest of BLOCK_N 32 / 64 / 128 x splits 64 / 128 / 256 x stages 1 / 2 / 3 for q8_0 and
#: fp8, within 10% of it for int8 (tools/attention_sweep.py ``--kv-types``; BENCHMARKS.md)
_BLOCK_N, _STAGES, _WARPS, _MOST_SPLITS = 128, 2, 4, 128


def _format(codes: Tensor, scales: Tensor):
    """The kvquant format of a pool of ``codes`` and ``scales``."""
    from strata_core.model.kvquant import kv_format

    if codes.dtype == torch.uint8:
        return kv_format("fp8")
    return kv_format("q8_0" if scales.dtype == torch.float16 else "int8")


def _rope_kv_q_ref(qkv: Tensor, positions: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, theta: float,
                   eps: float, n_heads: int, n_kv_heads: int, key_pool: Tensor, value_pool: Tensor, key_scales: Tensor,
                   value_scales: Tensor, block_table: Tensor | None, table: Tensor | None,
                   inv_freq: Tensor | None = None, mscale: float = 1.0) -> Tensor:
    block_table = _need_blocks(block_table)
    fmt = _format(key_pool, key_scales)
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads)
    if q_norm is not None:
        q = _rms(q, q_norm, eps)
    if k_norm is not None:
        k = _rms(k, k_norm, eps)
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta, inv_freq, mscale)  # [B, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    (kc, ks), (vc, vs) = quantize(k, fmt), quantize(v, fmt)
    bs = key_pool.shape[1]
    for b, p in enumerate(positions.tolist()):
        block = int(block_table[b, p // bs])
        key_pool[block, p % bs], key_scales[block, p % bs] = kc[b], ks[b]
        value_pool[block, p % bs], value_scales[block, p % bs] = vc[b], vs[b]
    return q.contiguous()


def _attention_q_ref(q: Tensor, positions: Tensor, key_pool: Tensor, value_pool: Tensor, key_scales: Tensor,
                     value_scales: Tensor, block_table: Tensor | None, table: Tensor | None, splits: int = 0) -> Tensor:
    block_table = _need_blocks(block_table)
    B, nh, D = q.shape
    bs = key_pool.shape[1]
    flat = [t.flatten(0, 1) for t in (key_pool, value_pool, key_scales, value_scales)]  # [n_blocks * bs, nkv, .]
    out = []
    for b, p in enumerate(positions.tolist()):
        rows = _paged_rows(block_table.to(q.device), b, torch.arange(p + 1, device=q.device), bs)
        kb = dequantize(flat[0][rows], flat[2][rows], q.dtype).float()  # [S, nkv, D]
        vb = dequantize(flat[1][rows], flat[3][rows], q.dtype).float()
        rep = nh // kb.shape[1]
        kb = kb.transpose(0, 1).repeat_interleave(rep, dim=0)  # [nh, S, D]
        vb = vb.transpose(0, 1).repeat_interleave(rep, dim=0)
        scores = (q[b].float()[:, None, :] @ kb.transpose(1, 2))[:, 0] * D ** -0.5  # [nh, S]
        probs = torch.softmax(scores, dim=-1)
        out.append((probs[:, None, :] @ vb)[:, 0].reshape(nh * D))  # [nh*D]
    return torch.stack(out).to(q.dtype) if out else q.new_empty((0, nh * D))


def kv_table_q(key_pool: Tensor, value_pool: Tensor, key_scales: Tensor, value_scales: Tensor,
               block_tables: Sequence[Tensor]) -> Tensor:
    """int64 ``[B, 5]`` on the host: the key and value codes, each session's block table, the key and
    value scales addresses."""
    return torch.tensor([[key_pool.data_ptr(), value_pool.data_ptr(), t.data_ptr(), key_scales.data_ptr(),
                          value_scales.data_ptr()] for t in block_tables], dtype=torch.int64).view(len(block_tables), 5)


def _rope_kv_q_fake(qkv, positions, q_norm, k_norm, theta, eps, n_heads, n_kv_heads, key_pool, value_pool,
                    key_scales, value_scales, block_table, table, inv_freq=None, mscale=1.0):
    D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    return qkv.new_empty((qkv.shape[0], n_heads, D))


def _attention_q_fake(q, positions, key_pool, value_pool, key_scales, value_scales, block_table, table, splits=0):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


rope_kv_write_q = torch.library.custom_op(
    "strata::rope_kv_write_q", _rope_kv_q_ref, mutates_args=("key_pool", "value_pool", "key_scales", "value_scales"),
    schema=("(Tensor qkv, Tensor positions, Tensor? q_norm, Tensor? k_norm, float theta, float eps, int n_heads, "
            "int n_kv_heads, Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor(c!) key_scales, "
            "Tensor(d!) value_scales, Tensor? block_table, Tensor? table, Tensor? inv_freq=None, "
            "float mscale=1.0) -> Tensor"))
decode_attention_q = torch.library.custom_op(
    "strata::decode_attention_q", _attention_q_ref, mutates_args=(),
    schema=("(Tensor q, Tensor positions, Tensor key_pool, Tensor value_pool, Tensor key_scales, "
            "Tensor value_scales, Tensor? block_table, Tensor? table, int splits=0) -> Tensor"))
rope_kv_write_q.register_fake(_rope_kv_q_fake)
decode_attention_q.register_fake(_attention_q_fake)

#: the kv types the Triton kernels serve (fp8 needs float8 e4m3 in Triton: sm_89 and later)
KERNEL_KV_TYPES = ("q8_0", "int8", "fp8")


def fused_quantized_supported(kv_type: str, head_dim: int, device: torch.device | None = None) -> bool:
    """Whether the CUDA kernels of this module serve a ``kv_type`` KV of ``head_dim`` (a power of two >= 16) on
    ``device``: fp8 e4m3 codes need a GPU that converts them (compute capability 8.9 or later)."""
    if kv_type == "fp8" and (device is None or device.type != "cuda" or not torch.cuda.is_available()
                             or torch.cuda.get_device_capability(device) < (8, 9)):
        return False
    return HAS_TRITON and kv_type in KERNEL_KV_TYPES and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.decode import _attention_reduce_kernel
    from strata_core.ops.dense import _norm_rope_halves, rope_frequencies

    _LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # False: the interpreter runs the kernels

    @triton.jit
    def _ptr(table, b, which, dt: tl.constexpr):
        """Entry ``which`` of session b's row of the ``[B, 5]`` address table, as a pointer to ``dt``."""
        return tl.load(table + b * 5 + which).to(tl.pointer_type(dt))

    @triton.jit
    def _codes_ptr(table, b, which):
        """The key (``which`` 0) or value (1) codes of session b's row of the address table: 16-byte aligned
        (``_check_q``), which Triton cannot know of an address it loads; said here, so that a row's codes are
        stored several bytes at a time (the hint on the address as loaded: one on a call's result is lost)."""
        return tl.multiple_of(tl.load(table + b * 5 + which).to(tl.pointer_type(tl.int8)), 16)

    @triton.jit
    def _codes_of(x, inv, QMAX: tl.constexpr, FP8: tl.constexpr):
        """int8 codes of float32 ``x`` times ``inv``, clamped to QMAX: rounded halves away from zero (C's
        roundf); ``FP8``: e4m3's bytes (nearest, ties to even) as int8 (one return type for both)."""
        y = x * inv
        if FP8:
            return tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.float8e4nv).to(tl.int8, bitcast=True)
        r = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
        return tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int8)

    @triton.jit
    def _store_quantized(a, c, codes, scales, row, srow, HALF: tl.constexpr, GH: tl.constexpr, QMAX: tl.constexpr,
                         FP8: tl.constexpr):
        """Quantize a row's halves ``a``, ``c`` (float32 ``[HALF]``) and store codes at ``codes + row`` and its
        scales at ``scales + srow``: one scale for the row (``GH`` 0) or ``GH`` groups of 32 in each half."""
        i = tl.arange(0, HALF)
        sdt = scales.dtype.element_ty
        if GH == 0:
            amax = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(c), axis=0))
            d = tl.div_rn(amax, QMAX)
            inv = tl.where(d > 0, tl.div_rn(1.0, d), 0.0)
            tl.store(codes + row + i, _codes_of(a, inv, QMAX, FP8))
            tl.store(codes + row + HALF + i, _codes_of(c, inv, QMAX, FP8))
            tl.store(scales + srow, d.to(sdt))
        else:
            g = tl.arange(0, GH)
            a2 = tl.reshape(a, (GH, 32))
            c2 = tl.reshape(c, (GH, 32))
            da = tl.div_rn(tl.max(tl.abs(a2), axis=1), QMAX)  # [GH]
            dc = tl.div_rn(tl.max(tl.abs(c2), axis=1), QMAX)
            ia = tl.where(da > 0, tl.div_rn(tl.full([GH], 1.0, tl.float32), da), 0.0)
            ic = tl.where(dc > 0, tl.div_rn(tl.full([GH], 1.0, tl.float32), dc), 0.0)
            tl.store(codes + row + i, tl.reshape(_codes_of(a2, ia[:, None], QMAX, FP8), (HALF,)))
            tl.store(codes + row + HALF + i, tl.reshape(_codes_of(c2, ic[:, None], QMAX, FP8), (HALF,)))
            tl.store(scales + srow + g, da.to(sdt))
            tl.store(scales + srow + GH + g, dc.to(sdt))

    @triton.jit
    def _rope_kv_q_kernel(qkv, pos, qw, kw, q_out, table, n_heads, n_kv, eps, theta, log2_theta, freq, mscale,
                          D: tl.constexpr, HALF: tl.constexpr, QNORM: tl.constexpr, KNORM: tl.constexpr,
                          BS: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, QMAX: tl.constexpr,
                          SDT: tl.constexpr, FREQ: tl.constexpr, LIBDEVICE: tl.constexpr, FP8: tl.constexpr):
        """Program (b, head): q heads first, then kv heads (k normed and rotated, k and v quantized)."""
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        width = (n_heads + 2 * n_kv) * D
        i = tl.arange(0, HALF)
        p = tl.load(pos + b)
        dt = q_out.dtype.element_ty
        src = qkv + b * width + head * D
        a = tl.load(src + i).to(tl.float32)
        c = tl.load(src + HALF + i).to(tl.float32)
        if head < n_heads:
            a, c = _norm_rope_halves(a, c, qw, p.to(tl.float32), eps, theta, log2_theta, freq, mscale, dt, D, HALF,
                                     QNORM, FREQ, LIBDEVICE)
            dst = q_out + (b * n_heads + head) * D
            tl.store(dst + i, a.to(dt))
            tl.store(dst + HALF + i, c.to(dt))
        else:
            g = head - n_heads
            a, c = _norm_rope_halves(a, c, kw, p.to(tl.float32), eps, theta, log2_theta, freq, mscale, dt, D, HALF,
                                     KNORM, FREQ, LIBDEVICE)
            block = tl.load(_ptr(table, b, 2, tl.int32) + p // BS).to(tl.int64)
            at = (block * BS + p % BS) * n_kv + g
            _store_quantized(a.to(dt).to(tl.float32), c.to(dt).to(tl.float32), _codes_ptr(table, b, 0),
                             _ptr(table, b, 3, SDT), at * D, at * G, HALF, GH, QMAX, FP8)
            vsrc = qkv + b * width + (n_heads + n_kv + g) * D
            _store_quantized(tl.load(vsrc + i).to(tl.float32), tl.load(vsrc + HALF + i).to(tl.float32),
                             _codes_ptr(table, b, 1), _ptr(table, b, 4, SDT), at * D, at * G, HALF, GH, QMAX, FP8)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` accumulated in float32; ``IEEE``: float32 products (float32 compute; the interpreter, whose
        bf16 dot is wrong)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _codes_tile(base, offsets, mask, dt, FP8: tl.constexpr):
        """The codes at ``base + offsets`` (``[BLOCK_N, W]``: rows of W contiguous bytes at 16-byte boundaries,
        as rows of D codes in 16-byte aligned pools are, ``_check_q``; so loaded 16 bytes at a time) as ``dt``
        values, exactly: int8 codes (|c| <= 127) and e4m3 values fit bf16, float16 and float32."""
        ptr = tl.max_contiguous(tl.multiple_of(base + offsets, [16, 16]), [1, 16])
        codes = tl.load(ptr, mask=mask, other=0)
        if FP8:
            return codes.to(tl.float8e4nv, bitcast=True).to(dt)
        return codes.to(dt)

    @triton.jit
    def _attention_q_split_kernel(q, pos, table, m_out, l_out, acc_out, n_heads, n_kv, scale,
                                  REP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                  SPLITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, SDT: tl.constexpr,
                                  IEEE: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr):
        """Program (b, kv head g, split s): the REP query heads of g over split s of positions 0..pos[b].

        A row's D values are G groups of W = D / G, each with its scale (G == 1: one scale a row). Each group
        of a tile of keys is its own [BLOCK_N, W] tile of codes (its own loads: no reshape), multiplied by the
        codes as they are (exact in the dot's dtype) and scaled after the dot: scores = sum over groups of
        (q_j @ codes_j^T) * kscale_j; for the values each group's scale joins the probabilities:
        acc_j += (p * vscale_j) @ codes_j, one [RP, W] accumulator a group. The value products are in bf16
        whatever q's dtype (float16 would lose p * scale's small values). Dequantizing each tile before the
        dots instead (codes x scales rounded to q's dtype, as ``kvquant.dequantize``) timed 4-6% slower for int8
        and q8_0, 5% faster for fp8 (H200, 32K, BLOCK_N 32): one form is kept."""
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(pos + b) + 1
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, n)
        W: tl.constexpr = D // G
        r = tl.arange(0, RP)
        c = tl.arange(0, W)
        rows = b * n_heads + g * REP + r  # [RP] query heads of this group
        keep = r < REP
        dt = q.dtype.element_ty
        kdt = tl.float32 if IEEE else dt  # the key products' dtype
        vdt = tl.float32 if IEEE else tl.bfloat16  # the value products' dtype
        kc = _ptr(table, b, 0, tl.int8)
        vc = _ptr(table, b, 1, tl.int8)
        bt = _ptr(table, b, 2, tl.int32)
        ksc = _ptr(table, b, 3, SDT)
        vsc = _ptr(table, b, 4, SDT)
        qs = ()  # q's G groups of columns, [RP, W] each
        accs = ()  # the G groups' float32 sums, [RP, W] each
        for j in tl.static_range(G):
            qs = qs + (tl.load(q + rows[:, None] * D + j * W + c[None, :], mask=keep[:, None], other=0.0).to(kdt),)
            accs = accs + (tl.zeros([RP, W], dtype=tl.float32),)
        m_i = tl.full([RP], float("-inf"), tl.float32)
        l_i = tl.zeros([RP], dtype=tl.float32)
        for t0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            t = t0 + tl.arange(0, BLOCK_N)
            tm = t < end
            block = tl.load(bt + t // BS, mask=tm, other=0).to(tl.int64)  # [BLOCK_N] block ids
            head_row = (block * BS + t % BS) * n_kv + g  # [BLOCK_N] rows of kv head g
            at = head_row[:, None] * D + c[None, :]  # [BLOCK_N, W]: group 0's codes
            sc = tl.zeros([RP, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(G):
                ks = tl.load(ksc + head_row * G + j, mask=tm, other=0.0).to(tl.float32)  # [BLOCK_N]
                sc += _dot(qs[j], tl.trans(_codes_tile(kc, at + j * W, tm[:, None], kdt, FP8)), IEEE) * ks[None, :]
            sc = tl.where(tm[None, :], sc * scale, float("-inf"))  # [RP, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            new = ()
            for j in tl.static_range(G):
                vs = tl.load(vsc + head_row * G + j, mask=tm, other=0.0).to(tl.float32)  # [BLOCK_N]
                pv = _dot((pr * vs[None, :]).to(vdt), _codes_tile(vc, at + j * W, tm[:, None], vdt, FP8), IEEE)
                new = new + (accs[j] * alpha[:, None] + pv,)
            accs = new
            m_i = m_new
        part = rows * SPLITS + s
        tl.store(m_out + part, m_i, mask=keep)
        tl.store(l_out + part, l_i, mask=keep)
        for j in tl.static_range(G):
            tl.store(acc_out + part[:, None] * D + j * W + c[None, :], accs[j], mask=keep[:, None])

    _SDT = {torch.float16: tl.float16, torch.float32: tl.float32}

    def _check_q(dtype: torch.dtype, pools: Sequence[Tensor]) -> tuple[int, int, float, bool]:
        """``(G, GH, qmax, fp8)`` of int8 / q8_0 / fp8 pools (ValueError naming what is wrong otherwise)."""
        kp, vp, ks, vs = pools
        D = kp.shape[-1]
        G = ks.shape[-1]
        fp8 = kp.dtype == torch.uint8
        ok = (kp.dtype == vp.dtype and kp.dtype in (torch.int8, torch.uint8) and ks.dtype == vs.dtype
              and ks.dtype in _SDT and (not fp8 or (G == 1 and ks.dtype == torch.float32))
              and kp.shape == vp.shape and ks.shape == vs.shape and kp.dim() == 4 and ks.shape[:3] == kp.shape[:3]
              and all(t.is_contiguous() for t in pools) and (G == 1 or (ks.dtype == torch.float16 and D == 32 * G))
              and kp.data_ptr() % 16 == 0 and vp.data_ptr() % 16 == 0)
        if not ok:
            raise ValueError(f"the quantized KV pools of one decode call must be contiguous int8 (fp8: uint8) "
                             f"codes [n_blocks, block_size, n_kv_heads, D] and scales [..., 1] or [..., D / 32] of one "
                             f"shape each, the codes 16-byte aligned, got {kp.dtype} {tuple(kp.shape)}, {ks.dtype} "
                             f"{tuple(ks.shape)}")
        return G, (D // 64 if G > 1 else 0), 448.0 if fp8 else 127.0, fp8

    def _device_table_q(pools: Sequence[Tensor], block_table: Tensor | None, device: torch.device) -> Tensor:
        block_table = _need_blocks(block_table)
        if block_table.device != device or block_table.dtype != torch.int32 or not block_table.is_contiguous():
            raise ValueError("the block table of a CUDA decode call must be a contiguous int32 tensor on its device")
        return kv_table_q(*pools, list(block_table)).pin_memory().to(device, non_blocking=True)

    def _rope_kv_q_cuda(qkv: Tensor, positions: Tensor, q_norm: Tensor | None, k_norm: Tensor | None,
                        theta: float, eps: float, n_heads: int, n_kv_heads: int, key_pool: Tensor,
                        value_pool: Tensor, key_scales: Tensor, value_scales: Tensor, block_table: Tensor | None,
                        table: Tensor | None, inv_freq: Tensor | None = None,
                        mscale: float = 1.0) -> Tensor:
        B = qkv.shape[0]
        D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        q = qkv.new_empty((B, n_heads, D))
        if B == 0:
            return q
        pools = (key_pool, value_pool, key_scales, value_scales)
        G, GH, qmax, fp8 = _check_q(qkv.dtype, pools)
        table = _device_table_q(pools, block_table, qkv.device) if table is None else table
        with on_device(qkv.device):
            _rope_kv_q_kernel[(B, n_heads + n_kv_heads)](
                qkv.contiguous(), positions.contiguous(), q_norm if q_norm is not None else qkv,
                k_norm if k_norm is not None else qkv, q, table, n_heads, n_kv_heads, eps, float(theta),
                math.log2(theta), rope_frequencies(inv_freq, qkv), float(mscale), D=D, HALF=D // 2,
                QNORM=q_norm is not None, KNORM=k_norm is not None,
                BS=key_pool.shape[1], G=G, GH=GH, QMAX=qmax, SDT=_SDT[key_scales.dtype], FREQ=inv_freq is not None,
                LIBDEVICE=_LIBDEVICE, FP8=fp8, num_warps=1)
        return q

    def _attention_q_cuda(q: Tensor, positions: Tensor, key_pool: Tensor, value_pool: Tensor, key_scales: Tensor,
                          value_scales: Tensor, block_table: Tensor | None, table: Tensor | None,
                          splits: int = 0) -> Tensor:
        B, nh, D = q.shape
        out = q.new_empty((B, nh * D))
        if B == 0:
            return out
        pools = (key_pool, value_pool, key_scales, value_scales)
        G, _, _, fp8 = _check_q(q.dtype, pools)
        nkv = key_pool.shape[2]
        rep = nh // nkv
        table = _device_table_q(pools, block_table, q.device) if table is None else table
        splits = _attention_splits(B, nkv, splits, _MOST_SPLITS)
        m = torch.empty((B * nh * splits,), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty((B * nh * splits, D), dtype=torch.float32, device=q.device)
        with on_device(q.device):
            _attention_q_split_kernel[(B, nkv, splits)](
                q.contiguous(), positions.contiguous(), table, m, l, acc, nh, nkv, D ** -0.5,
                REP=rep, RP=max(16, triton.next_power_of_2(rep)), D=D, BLOCK_N=_BLOCK_N, SPLITS=splits,
                BS=key_pool.shape[1], G=G, SDT=_SDT[key_scales.dtype],
                IEEE=q.dtype == torch.float32 or not _LIBDEVICE, FP8=fp8, STAGES=_STAGES,
                num_warps=_WARPS)
            # a warp per 32 splits: the [SPLITS, D] partial sums of a row in registers without spilling
            _attention_reduce_kernel[(B * nh,)](m, l, acc, out, D=D, SPLITS=splits,
                                                num_warps=min(8, max(1, splits // 32)))
        return out

    rope_kv_write_q.register_kernel("cuda")(_rope_kv_q_cuda)
    decode_attention_q.register_kernel("cuda")(_attention_q_cuda)
