"""Fused decode-step ops: few launches a layer for a decode window on CUDA, where a decode step of
small products is bound by launches and the host rather than by the GPU's arithmetic.

Each op is a ``strata::`` custom op whose CPU kernel is the torch reference (the oracle of
``torch.library.opcheck`` and of tests/test_kernels_cuda.py); on CUDA one Triton launch each
(``decode_attention``: two). A decode window of B sessions, one token each:

- ``add_rms_norm(h, delta, weight, eps) -> (h + delta, rms_norm(h + delta))``: the residual add
  and the next RMSNorm in one pass (the sum rounded to ``h.dtype`` first, as ``h + delta`` is);
- ``route_topk(logits, k, norm, scale, min_sum) -> (ids int64 [T, k], weights float32 [T, k])``:
  softmax over the experts in float32, top-k (largest first), optional renormalisation (the sum
  clamped to ``min_sum``) and scale;
- ``rope_kv_write(qkv, positions, q_norm, k_norm, theta, eps, n_heads, n_kv_heads, key_pool,
  value_pool, block_table, table, inv_freq=None, mscale=1.0) -> q [B, n_heads, D]``: the fused QKV
  projection's output split into heads, q and k RMS-normed per head (where weights are given) and
  NEOX-rotated at ``positions`` (``inv_freq`` and ``mscale``: a scaled RoPE such as YaRN, as
  ``rope_cos_sin`` takes them), k and v written into the paged KV of session b at ``positions[b]``;
- ``decode_attention(q, positions, key_pool, value_pool, block_table, table, splits=0) -> [B, n_heads * D]``:
  causal GQA attention of each session's query over its positions ``0..positions[b]`` (split over
  the context, flash-decoding style, then one reduce launch; ``splits`` programs per (session, kv
  head), 0: chosen from the batch size).

The KV is paged (model/kvpool.py): ``key_pool`` / ``value_pool`` are one layer's pool tensors
``[n_blocks, block_size, n_kv_heads, D]`` and session b's position p is row ``p % block_size`` of
block ``block_table[b, p // block_size]`` (int32 ``[B, max_blocks]``). ``table`` (int64 ``[B, 3]``:
the addresses of the key pool, the value pool and session b's block table row) is what the CUDA
kernels read to reach the KV; when it is None they build it from the pools and ``block_table``. A
decode window captured as a CUDA graph passes a static table that the engine refills before each
replay, so one graph serves any sessions of the same batch size (graphs.py): the pools and block
tables named then are those of the capture and only the CPU reference reads them (CUDA callers that
pass a table may pass no ``block_table``). The CUDA kernels move pool rows 16 bytes at a time: the pools
must be 16-byte aligned (whole allocations are; a view into another tensor may not be, a ValueError).

Tolerance against the references: float32 within a relative 1e-5, bf16 within its rounding
(tests/test_kernels_cuda.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from strata_core.model.ops import apply_rope, rms_norm, rope_cos_sin
from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["add_rms_norm", "decode_attention", "kv_table", "route_topk", "rope_kv_write"]


# --- references (the CPU kernels) ------------------------------------------------------------------

def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm(x, weight, eps)


def _add_rms_norm_ref(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = h + delta
    return total, _rms(total, weight, eps)


def _route_ref(logits: Tensor, k: int, norm: bool, scale: float, min_sum: float) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(min_sum)
    if scale != 1.0:
        weights = weights * scale
    return ids, weights


def _split_heads(qkv: Tensor, n_heads: int, n_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    B = qkv.shape[0]
    D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    return q.reshape(B, n_heads, D), k.reshape(B, n_kv_heads, D), v.reshape(B, n_kv_heads, D)


def _paged_rows(block_table: Tensor, b: int, positions: Tensor, block_size: int) -> Tensor:
    """int64 row ids in a pool viewed as ``[n_blocks * block_size, ...]`` of session b's ``positions``."""
    return block_table[b, positions // block_size].long() * block_size + positions % block_size


def _need_blocks(block_table: Tensor | None) -> Tensor:
    if block_table is None:
        raise ValueError("the reference of a paged decode op needs the block table")
    return block_table


def _rope_kv_ref(qkv: Tensor, positions: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, theta: float,
                 eps: float, n_heads: int, n_kv_heads: int, key_pool: Tensor, value_pool: Tensor,
                 block_table: Tensor | None, table: Tensor | None, inv_freq: Tensor | None = None,
                 mscale: float = 1.0) -> Tensor:
    block_table = _need_blocks(block_table)
    q, k, v = _split_heads(qkv, n_heads, n_kv_heads)
    if q_norm is not None:
        q = _rms(q, q_norm, eps)
    if k_norm is not None:
        k = _rms(k, k_norm, eps)
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta, inv_freq, mscale)  # [B, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    bs = key_pool.shape[1]
    for b, p in enumerate(positions.tolist()):
        block = int(block_table[b, p // bs])
        key_pool[block, p % bs] = k[b].to(key_pool.dtype)
        value_pool[block, p % bs] = v[b].to(value_pool.dtype)
    return q.contiguous()


def _attention_ref(q: Tensor, positions: Tensor, key_pool: Tensor, value_pool: Tensor, block_table: Tensor | None,
                   table: Tensor | None, splits: int = 0) -> Tensor:
    block_table = _need_blocks(block_table)
    B, nh, D = q.shape
    bs = key_pool.shape[1]
    keys, values = key_pool.flatten(0, 1), value_pool.flatten(0, 1)  # [n_blocks * bs, nkv, D]
    out = []
    for b, p in enumerate(positions.tolist()):
        rows = _paged_rows(block_table.to(keys.device), b, torch.arange(p + 1, device=keys.device), bs)
        kb, vb = keys[rows].float(), values[rows].float()  # [S, nkv, D]
        rep = nh // kb.shape[1]
        kb = kb.transpose(0, 1).repeat_interleave(rep, dim=0)  # [nh, S, D]
        vb = vb.transpose(0, 1).repeat_interleave(rep, dim=0)
        scores = (q[b].float()[:, None, :] @ kb.transpose(1, 2))[:, 0] * D ** -0.5  # [nh, S]
        probs = torch.softmax(scores, dim=-1)
        out.append((probs[:, None, :] @ vb)[:, 0].reshape(nh * D))  # [nh*D]
    return torch.stack(out).to(q.dtype) if out else q.new_empty((0, nh * D))


def kv_table(key_pool: Tensor, value_pool: Tensor, block_tables: Sequence[Tensor]) -> Tensor:
    """int64 ``[B, 3]`` on the host: one layer's key and value pool addresses and each session's block
    table (int32 ``[max_blocks]`` on the pools' device) address."""
    return torch.tensor([[key_pool.data_ptr(), value_pool.data_ptr(), t.data_ptr()] for t in block_tables],
                        dtype=torch.int64).view(len(block_tables), 3)


# --- fakes ---------------------------------------------------------------------------------------

def _add_rms_norm_fake(h, delta, weight, eps):
    return torch.empty_like(h), torch.empty_like(h)


def _route_fake(logits, k, norm, scale, min_sum):
    T = logits.shape[0]
    return (logits.new_empty((T, k), dtype=torch.int64), logits.new_empty((T, k), dtype=torch.float32))


def _rope_kv_fake(qkv, positions, q_norm, k_norm, theta, eps, n_heads, n_kv_heads, key_pool, value_pool,
                  block_table, table, inv_freq=None, mscale=1.0):
    D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    return qkv.new_empty((qkv.shape[0], n_heads, D))


def _attention_fake(q, positions, key_pool, value_pool, block_table, table, splits=0):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


add_rms_norm = torch.library.custom_op(
    "strata::add_rms_norm", _add_rms_norm_ref, mutates_args=(),
    schema="(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)")
route_topk = torch.library.custom_op(
    "strata::route_topk", _route_ref, mutates_args=(),
    schema="(Tensor logits, int k, bool norm, float scale, float min_sum) -> (Tensor, Tensor)")
rope_kv_write = torch.library.custom_op(
    "strata::rope_kv_write", _rope_kv_ref, mutates_args=("key_pool", "value_pool"),
    schema=("(Tensor qkv, Tensor positions, Tensor? q_norm, Tensor? k_norm, float theta, float eps, int n_heads, "
            "int n_kv_heads, Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor? block_table, Tensor? table, "
            "Tensor? inv_freq=None, float mscale=1.0) -> Tensor"))
decode_attention = torch.library.custom_op(
    "strata::decode_attention", _attention_ref, mutates_args=(),
    schema=("(Tensor q, Tensor positions, Tensor key_pool, Tensor value_pool, Tensor? block_table, Tensor? table, "
            "int splits=0) -> Tensor"))
add_rms_norm.register_fake(_add_rms_norm_fake)
route_topk.register_fake(_route_fake)
rope_kv_write.register_fake(_rope_kv_fake)
decode_attention.register_fake(_attention_fake)

#: Context positions one attention program covers at a time; the programs a (session, kv head) splits
#: into: ``_SPLITS``, or where None as many (16..64) as give a launch about ``_PROGRAMS`` programs
#: (chosen with tools/attention_sweep.py on the H200: 32 positions, 64 splits for one session and 32 for
#: four beat the alternatives at 1K and at 32K of context; see BENCHMARKS.md). ``_STAGES``: the pipeline
#: stages of the key loop (3: Triton's default for a plain loop; the sweep's CONFIGS try 1 and 2).
_BLOCK_N, _SPLITS, _STAGES, _PROGRAMS = 32, None, 3, 512
#: the splits of every launch under ``--batch-invariant``: a row's partial sums then do not depend on B
INVARIANT_SPLITS = 32


def _attention_splits(sessions: int, kv_heads: int, splits: int = 0, most: int = 64) -> int:
    """Programs per (session, kv head) of a decode attention launch: ``splits`` if given, else see ``_SPLITS``
    (the rule's at most ``most``)."""
    if splits:
        return splits
    if _SPLITS is not None:
        return _SPLITS
    want = max(1, _PROGRAMS // (sessions * kv_heads))
    return max(16, min(most, 1 << (want.bit_length() - 1)))

if HAS_TRITON:
    import triton
    import triton.language as tl

    from strata_core.ops.dense import _norm_rope_halves, rope_frequencies

    _LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # False: the interpreter runs the kernels

    @triton.jit
    def _add_rms_norm_kernel(h, d, w, s_out, x_out, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        dt = s_out.dtype.element_ty
        v = (tl.load(h + row * D + offs, mask=m, other=0.0).to(tl.float32)
             + tl.load(d + row * D + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
        tl.store(s_out + row * D + offs, v, mask=m)
        v = v.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        y = (v * r).to(dt).to(tl.float32)
        wt = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(x_out + row * D + offs, (wt * y).to(dt), mask=m)

    def _add_rms_norm_cuda(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        D = h.shape[-1]
        h, delta = h.contiguous(), delta.to(h.dtype).contiguous()
        total, normed = torch.empty_like(h), torch.empty_like(h)
        rows = h.numel() // D
        if rows:
            with on_device(h.device):
                _add_rms_norm_kernel[(rows,)](h, delta, weight, total, normed, D, eps,
                                              BLOCK=triton.next_power_of_2(D), num_warps=4 if D >= 1024 else 1)
        return total, normed

    @triton.jit
    def _route_kernel(logits, ids_out, w_out, E, min_sum, scale, K: tl.constexpr, EP: tl.constexpr,
                      KP: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, EP)
        valid = offs < E
        lg = tl.load(logits + row * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.where(valid, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
        cur = tl.where(valid, e / tl.sum(e, axis=0), -1.0)  # probabilities; -1 = taken or padding
        ks = tl.arange(0, KP)
        wsel = tl.zeros([KP], dtype=tl.float32)
        isel = tl.zeros([KP], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(cur, axis=0)
            idx = tl.min(tl.where(cur == best, offs, EP), axis=0)  # the first of equal values
            wsel = tl.where(ks == j, best, wsel)
            isel = tl.where(ks == j, idx.to(tl.int64), isel)
            cur = tl.where(offs == idx, -1.0, cur)
        if NORM:
            wsel = wsel / tl.maximum(tl.sum(wsel, axis=0), min_sum)
        if SCALE:
            wsel = wsel * scale
        keep = ks < K
        tl.store(ids_out + row * K + ks, isel, mask=keep)
        tl.store(w_out + row * K + ks, wsel, mask=keep)

    def _route_cuda(logits: Tensor, k: int, norm: bool, scale: float, min_sum: float) -> tuple[Tensor, Tensor]:
        T, E = logits.shape
        logits = logits.contiguous()
        ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
        weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
        if T:
            with on_device(logits.device):
                _route_kernel[(T,)](logits, ids, weights, E, min_sum, scale, K=k, EP=triton.next_power_of_2(E),
                                    KP=triton.next_power_of_2(k), NORM=norm, SCALE=scale != 1.0, num_warps=1)
        return ids, weights

    @triton.jit
    def _pool_ptr(table, b, which, dt: tl.constexpr):
        """This layer's K (``which`` 0) or V (1) pool, from session b's row of the address table. The pools are
        16-byte aligned (``_check_pools``), which Triton cannot know of an address it loads: said here, so that
        the rows of D values a kernel reads or writes there move 16 bytes at a time, not one value."""
        return tl.multiple_of(tl.load(table + b * 3 + which).to(tl.pointer_type(dt)), 16)

    @triton.jit
    def _blocks_ptr(table, b):
        """Session b's block table (int32 block ids), from its row of the address table."""
        return tl.load(table + b * 3 + 2).to(tl.pointer_type(tl.int32))

    @triton.jit
    def _rope_kv_kernel(qkv, pos, qw, kw, q_out, table, n_heads, n_kv, eps, theta, log2_theta, freq, mscale,
                        D: tl.constexpr, HALF: tl.constexpr, QNORM: tl.constexpr, KNORM: tl.constexpr,
                        BS: tl.constexpr, FREQ: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Program (b, head): q heads first, then kv heads (k normed and rotated, v copied)."""
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
            kc = _pool_ptr(table, b, 0, dt)
            vc = _pool_ptr(table, b, 1, dt)
            block = tl.load(_blocks_ptr(table, b) + p // BS).to(tl.int64)
            row = ((block * BS + p % BS) * n_kv + g) * D
            tl.store(kc + row + i, a.to(dt))
            tl.store(kc + row + HALF + i, c.to(dt))
            vsrc = qkv + b * width + (n_heads + n_kv + g) * D
            tl.store(vc + row + i, tl.load(vsrc + i))
            tl.store(vc + row + HALF + i, tl.load(vsrc + HALF + i))

    def _device_table(key_pool: Tensor, value_pool: Tensor, block_table: Tensor | None,
                      device: torch.device) -> Tensor:
        block_table = _need_blocks(block_table)
        if block_table.device != device or block_table.dtype != torch.int32 or not block_table.is_contiguous():
            raise ValueError("the block table of a CUDA decode call must be a contiguous int32 tensor on its device")
        table = kv_table(key_pool, value_pool, list(block_table))
        return table.pin_memory().to(device, non_blocking=True)

    def _check_pools(dtype: torch.dtype, key_pool: Tensor, value_pool: Tensor) -> None:
        for pool in (key_pool, value_pool):
            if pool.dtype != dtype or not pool.is_contiguous() or pool.shape != key_pool.shape or pool.dim() != 4:
                raise ValueError(f"the KV pools of one decode call must be contiguous {dtype} tensors "
                                 f"[n_blocks, block_size, n_kv_heads, D] of one shape, got {pool.dtype} "
                                 f"{tuple(pool.shape)}")
            if pool.data_ptr() % 16:  # the kernels load and store its rows 16 bytes at a time (_pool_ptr)
                raise ValueError(f"the KV pools of one decode call must be 16-byte aligned, got one at address "
                                 f"{pool.data_ptr():#x} (a view into another tensor?)")

    def _rope_kv_cuda(qkv: Tensor, positions: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, theta: float,
                      eps: float, n_heads: int, n_kv_heads: int, key_pool: Tensor, value_pool: Tensor,
                      block_table: Tensor | None, table: Tensor | None, inv_freq: Tensor | None = None,
                      mscale: float = 1.0) -> Tensor:
        B = qkv.shape[0]
        D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        q = qkv.new_empty((B, n_heads, D))
        if B == 0:
            return q
        _check_pools(qkv.dtype, key_pool, value_pool)
        table = _device_table(key_pool, value_pool, block_table, qkv.device) if table is None else table
        with on_device(qkv.device):
            _rope_kv_kernel[(B, n_heads + n_kv_heads)](
                qkv.contiguous(), positions.contiguous(), q_norm if q_norm is not None else qkv,
                k_norm if k_norm is not None else qkv, q, table, n_heads, n_kv_heads, eps, float(theta),
                math.log2(theta), rope_frequencies(inv_freq, qkv), float(mscale), D=D, HALF=D // 2,
                QNORM=q_norm is not None, KNORM=k_norm is not None, BS=key_pool.shape[1], FREQ=inv_freq is not None,
                LIBDEVICE=_LIBDEVICE, num_warps=1)
        return q

    @triton.jit
    def _attention_split_kernel(q, pos, table, m_out, l_out, acc_out, n_heads, n_kv, scale,
                                REP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                                SPLITS: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr):
        """Program (b, kv head g, split s): the REP query heads of g over split s of positions 0..pos[b]; the
        key and value tiles of the next ``STAGES - 1`` steps are in flight (16-byte asynchronous copies) while
        one step computes."""
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(pos + b) + 1
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, n)
        r = tl.arange(0, RP)
        d = tl.arange(0, D)
        rows = b * n_heads + g * REP + r  # [RP] query heads of this group
        keep = r < REP
        dt = q.dtype.element_ty
        qt = tl.load(q + rows[:, None] * D + d[None, :], mask=keep[:, None], other=0.0)  # [RP, D]
        kc = _pool_ptr(table, b, 0, dt)
        vc = _pool_ptr(table, b, 1, dt)
        bt = _blocks_ptr(table, b)
        m_i = tl.full([RP], float("-inf"), tl.float32)
        l_i = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, D], dtype=tl.float32)
        for t0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            t = t0 + tl.arange(0, BLOCK_N)
            tm = t < end
            block = tl.load(bt + t // BS, mask=tm, other=0).to(tl.int64)  # [BLOCK_N] block ids
            at = ((block * BS + t % BS)[:, None] * n_kv + g) * D + d[None, :]  # [BLOCK_N, D]
            k = tl.load(kc + at, mask=tm[:, None], other=0.0)
            if IEEE:  # float32 products (float32 caches; the interpreter, whose bf16 dot is wrong)
                sc = tl.dot(qt.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                sc = tl.dot(qt, tl.trans(k))
            sc = tl.where(tm[None, :], sc * scale, float("-inf"))  # [RP, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            v = tl.load(vc + at, mask=tm[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pr.to(dt).to(tl.float32), v.to(tl.float32),
                                                    input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(dt), v)
            m_i = m_new
        part = rows * SPLITS + s
        tl.store(m_out + part, m_i, mask=keep)
        tl.store(l_out + part, l_i, mask=keep)
        tl.store(acc_out + part[:, None] * D + d[None, :], acc, mask=keep[:, None])

    @triton.jit
    def _attention_reduce_kernel(m_in, l_in, acc_in, out, D: tl.constexpr, SPLITS: tl.constexpr):
        """Program (b * n_heads + h): the splits' partial softmax sums combined."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        m = tl.load(m_in + row * SPLITS + s)
        top = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # [SPLITS]
        total = tl.sum(tl.load(l_in + row * SPLITS + s) * w, axis=0)
        acc = tl.load(acc_in + (row * SPLITS + s)[:, None] * D + d[None, :])  # [SPLITS, D]
        o = tl.sum(acc * w[:, None], axis=0) / total
        tl.store(out + row * D + d, o.to(out.dtype.element_ty))

    def _attention_cuda(q: Tensor, positions: Tensor, key_pool: Tensor, value_pool: Tensor,
                        block_table: Tensor | None, table: Tensor | None, splits: int = 0) -> Tensor:
        B, nh, D = q.shape
        out = q.new_empty((B, nh * D))
        if B == 0:
            return out
        _check_pools(q.dtype, key_pool, value_pool)
        nkv = key_pool.shape[2]
        rep = nh // nkv
        table = _device_table(key_pool, value_pool, block_table, q.device) if table is None else table
        splits = _attention_splits(B, nkv, splits)
        m = torch.empty((B * nh * splits,), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty((B * nh * splits, D), dtype=torch.float32, device=q.device)
        with on_device(q.device):
            _attention_split_kernel[(B, nkv, splits)](
                q.contiguous(), positions.contiguous(), table, m, l, acc, nh, nkv, D ** -0.5,
                REP=rep, RP=max(16, triton.next_power_of_2(rep)), D=D, BLOCK_N=_BLOCK_N, SPLITS=splits,
                BS=key_pool.shape[1], IEEE=q.dtype == torch.float32 or not _LIBDEVICE, STAGES=_STAGES, num_warps=4)
            _attention_reduce_kernel[(B * nh,)](m, l, acc, out, D=D, SPLITS=splits, num_warps=1)
        return out

    add_rms_norm.register_kernel("cuda")(_add_rms_norm_cuda)
    route_topk.register_kernel("cuda")(_route_cuda)
    rope_kv_write.register_kernel("cuda")(_rope_kv_cuda)
    decode_attention.register_kernel("cuda")(_attention_cuda)


def fused_decode_supported(head_dim: int) -> bool:
    """Whether the CUDA kernels of this module serve a model with ``head_dim`` (a power of two >= 16)."""
    return HAS_TRITON and head_dim >= 16 and head_dim & (head_dim - 1) == 0
