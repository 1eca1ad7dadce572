"""``strata::mla_attention``: multi-head latent attention (deepseek2) over the latent cache.

The absorbed form of MLA (strata_core/model/deepseek2/forward.py): every head's query has been taken into
latent space (``q_lat = q_nope attn_k_b``); all heads attend over the one shared cache of normed
latents and rope keys (MQA-like), and the attended latent goes through ``attn_v_b`` afterwards::

    mla_attention(q_lat [nh, T, C], q_rope [nh, T, r], latent [S, C], rope [S, r], positions [T], scale)
        -> [nh, T, C] = softmax(scale * (q_lat . latent + q_rope . rope)) @ latent

causal by ``positions``: query row t sees cache rows ``0..positions[t]`` (and no row past ``S``).
The caches are read in place (views of the KV cache's tensors, row-strided); the output has the
cache's dtype.

- CPU (the reference, the oracle of opcheck and of tests/test_deepseek2_cuda.py): the model's torch
  form, one product of ``[q_lat, q_rope]`` with ``[latent, rope]`` over all ``S`` rows, masked,
  softmax in float32, probabilities rounded to the cache dtype before the product with the latent.
- CUDA (Triton, two launches): flash decoding. Program (head block, split, query row) takes
  ``BLOCK_H`` heads (``tl.dot`` of ``[BLOCK_H, C] x [C, BLOCK_N]``: each latent tile is loaded once
  for the block and serves both the scores and the weighted sum) over one of ``SPLITS`` slices of the
  visible rows, with an online softmax in float32; a second launch merges the slices' partial sums
  in a fixed order (deterministic: the slices depend only on the visible length). Head blocks are the
  fastest grid axis so the blocks of one slice read the same latent rows together (L2). The grid
  does not depend on ``positions`` (read on the device), so a captured CUDA graph replays it for any
  step. Scores and sums are float32; bf16 caches take bf16 products with float32 accumulation, float32
  caches IEEE float32 products. The blocking (``BLOCK_H``, ``BLOCK_N``, ``SPLITS``, ``WARPS``) is
  read at each call; tools/bench_mla.py times a few others.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from strata_core.ops.matmul import matmul
from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["mla_attention", "mla_blocked", "mla_reference"]  # and mla_triton where Triton is installed


def mla_reference(q_lat: Tensor, q_rope: Tensor, latent: Tensor, rope: Tensor, positions: Tensor,
                  scale: float) -> Tensor:
    """The torch form of ``mla_attention`` on any device (its CPU kernel): ``[nh, T, C]``."""
    S = latent.shape[0]
    query = torch.cat((q_lat, q_rope), dim=-1)  # [nh, T, C + r]
    keys = torch.cat((latent, rope), dim=-1)  # [S, C + r]
    scores = matmul(query, keys.T) * scale  # [nh, T, S]
    visible = torch.arange(S, device=positions.device)[None, :] <= positions[:, None]  # [T, S]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1)  # [nh, T, S]
    return matmul(probs.to(latent.dtype), latent).contiguous()  # [nh, T, C] (the CPU's matmul pads rows)


def mla_blocked(q_lat: Tensor, q_rope: Tensor, latent, rope, positions: Tensor, scale: float,
                block: int = 256) -> Tensor:
    """``mla_attention`` over a quantized cache (``latent``, ``rope``: ``QuantizedRows`` of ``[S, C]``, ``[S, r]``,
    kvquant.py) on any device: ``[nh, T, C]`` in ``q_lat``'s dtype. The rows go in blocks of ``block``
    positions, each dequantized to ``q_lat``'s dtype when it is read and merged by an online softmax in
    float32 (no dequantized copy of the whole cache)."""
    nh, T, C = q_lat.shape
    S = latent.shape[0]
    query = torch.cat((q_lat, q_rope), dim=-1)  # [nh, T, C + r]
    top = total = acc = None
    for first in range(0, S, block):
        last = min(S, first + block)
        lat = latent.rows(first, last, q_lat.dtype)  # [b, C]
        keys = torch.cat((lat, rope.rows(first, last, q_lat.dtype)), dim=-1)  # [b, C + r]
        scores = (matmul(query, keys.T) * scale).float()  # [nh, T, b]
        visible = torch.arange(first, last, device=positions.device)[None, :] <= positions[:, None]  # [T, b]
        scores = scores.masked_fill(~visible, float("-inf"))
        new_top = scores.amax(-1, keepdim=True) if top is None else torch.maximum(top, scores.amax(-1, keepdim=True))
        shift = new_top.nan_to_num(0.0, 0.0, 0.0)  # a row that sees no key yet: every term exp(-inf) = 0
        weights = torch.exp(scores - shift)  # [nh, T, b]
        part = matmul(weights.to(q_lat.dtype), lat).float()  # [nh, T, C]
        if top is None:
            total, acc = weights.sum(-1, keepdim=True), part
        else:
            rescale = torch.exp(top - shift)
            total, acc = total * rescale + weights.sum(-1, keepdim=True), acc * rescale + part
        top = new_top
    return (acc / total).to(q_lat.dtype).contiguous()


def _mla_fake(q_lat, q_rope, latent, rope, positions, scale):
    return latent.new_empty((q_lat.shape[0], q_lat.shape[1], latent.shape[1]))


mla_attention = torch.library.custom_op(
    "strata::mla_attention", mla_reference, mutates_args=(),
    schema="(Tensor q_lat, Tensor q_rope, Tensor latent, Tensor rope, Tensor positions, float scale) -> Tensor")
mla_attention.register_fake(_mla_fake)

#: Heads per program, cache rows per tile, the slices the visible rows split into, warps per program.
#: At DeepSeek-V3's C = 512 for sm_90 (offline ptxas): 214 registers a thread, no spills, 39 KB of
#: shared memory in bf16 (199 registers, 73 KB in float32); BLOCK_N = 32 spills at 4 warps.
BLOCK_H, BLOCK_N, SPLITS, WARPS = 16, 16, 32, 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    _INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's bf16 dot is wrong: float32 there

    @triton.jit
    def _mla_split_kernel(ql, qr, lat, rp, pos, m_out, l_out, acc_out, n_heads, S, scale,
                          s_qlh, s_qlt, s_qrh, s_qrt, s_lat, s_rp,
                          C: tl.constexpr, CP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                          IEEE: tl.constexpr):
        """Program (head block, split, query row t): partial softmax sums of the block's heads over
        split s of rows ``0..min(positions[t], S - 1)``."""
        hb = tl.program_id(0)
        s = tl.program_id(1)
        t = tl.program_id(2).to(tl.int64)
        n = tl.minimum(tl.load(pos + t) + 1, S)
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, n)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < n_heads
        c = tl.arange(0, CP)
        cm = c < C
        r = tl.arange(0, RP)
        rm = r < R
        q1 = tl.load(ql + h[:, None] * s_qlh + t * s_qlt + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
        q2 = tl.load(qr + h[:, None] * s_qrh + t * s_qrt + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        dt = lat.dtype.element_ty
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, CP], dtype=tl.float32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            kl = tl.load(lat + j[:, None].to(tl.int64) * s_lat + c[None, :], mask=jm[:, None] & cm[None, :],
                         other=0.0)  # [BLOCK_N, CP]
            kr = tl.load(rp + j[:, None].to(tl.int64) * s_rp + r[None, :], mask=jm[:, None] & rm[None, :],
                         other=0.0)  # [BLOCK_N, RP]
            if IEEE:
                sc = (tl.dot(q1.to(tl.float32), tl.trans(kl.to(tl.float32)), input_precision="ieee")
                      + tl.dot(q2.to(tl.float32), tl.trans(kr.to(tl.float32)), input_precision="ieee"))
            else:
                sc = tl.dot(q1, tl.trans(kl)) + tl.dot(q2, tl.trans(kr))
            sc = tl.where(jm[None, :], sc * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(dt).to(tl.float32), kl.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(dt), kl)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        part = (t * n_heads + h) * SPLITS + s  # [BLOCK_H]
        tl.store(m_out + part, m_i, mask=hm)
        tl.store(l_out + part, l_i, mask=hm)
        tl.store(acc_out + part[:, None] * C + c[None, :], acc, mask=hm[:, None] & cm[None, :])

    @triton.jit
    def _mla_merge_kernel(m_in, l_in, acc_in, out, n_heads, T, C: tl.constexpr, CP: tl.constexpr,
                          SPLITS: tl.constexpr):
        """Program (t * n_heads + head): the splits' partial sums merged in split order."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SPLITS)
        c = tl.arange(0, CP)
        cm = c < C
        m = tl.load(m_in + row * SPLITS + s)
        top = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)  # [SPLITS]
        total = tl.sum(tl.load(l_in + row * SPLITS + s) * w, axis=0)
        o = tl.zeros([CP], dtype=tl.float32)
        for i in tl.static_range(SPLITS):
            wi = tl.sum(tl.where(s == i, w, 0.0), axis=0)
            o += wi * tl.load(acc_in + (row * SPLITS + i) * C + c, mask=cm, other=0.0)
        head = row % n_heads
        t = row // n_heads
        tl.store(out + (head * T + t) * C + c, (o / total).to(out.dtype.element_ty), mask=cm)

    def mla_triton(q_lat: Tensor, q_rope: Tensor, latent: Tensor, rope: Tensor, positions: Tensor,
                   scale: float) -> Tensor:
        """The Triton kernels of ``mla_attention`` on the tensors' device (CUDA; CPU tensors under
        ``TRITON_INTERPRET=1``, where bf16 runs the float32 products)."""
        nh, T, C = q_lat.shape
        S, R = latent.shape[0], rope.shape[1]
        out = latent.new_empty((nh, T, C))
        if T == 0 or nh == 0:
            return out
        if latent.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"mla_attention on CUDA takes bf16, fp16 or float32 caches, got {latent.dtype}")
        for name, x, last in (("q_lat", q_lat, C), ("q_rope", q_rope, R), ("latent", latent, C), ("rope", rope, R)):
            if x.dtype != latent.dtype or x.stride(-1) != 1 or x.shape[-1] != last:
                raise ValueError(f"mla_attention: {name} must be a {latent.dtype} tensor with unit stride in its "
                                 f"last dim of size {last}, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        if rope.shape[0] != S:
            raise ValueError(f"mla_attention: latent has {S} rows, rope {rope.shape[0]}")
        ieee = latent.dtype == torch.float32 or _INTERPRET
        rows = T * nh * SPLITS
        m = torch.empty((rows,), dtype=torch.float32, device=latent.device)
        l = torch.empty_like(m)
        acc = torch.empty((rows, C), dtype=torch.float32, device=latent.device)
        cp, rp = max(16, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(R))
        with on_device(latent.device):
            _mla_split_kernel[(triton.cdiv(nh, BLOCK_H), SPLITS, T)](
                q_lat, q_rope, latent, rope, positions.contiguous(), m, l, acc, nh, S, scale,
                q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), latent.stride(0),
                rope.stride(0), C=C, CP=cp, R=R, RP=rp, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, SPLITS=SPLITS,
                IEEE=ieee, num_warps=WARPS, num_stages=1 if ieee else 2)
            _mla_merge_kernel[(T * nh,)](m, l, acc, out, nh, T, C=C, CP=cp, SPLITS=SPLITS, num_warps=4)
        return out

    mla_attention.register_kernel("cuda")(mla_triton)
