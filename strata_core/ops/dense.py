"""Fused Triton kernels for the dense part of a layer on CUDA: RMSNorm, and QK-norm + RoPE in one pass.

A decode token runs every layer's small ops once; in torch each RMSNorm is ~7 kernels and the
RoPE tables plus their application ~18, i.e. hundreds of launches a token. These kernels do each
in one launch (``strata_core.model.ops`` calls them for CUDA tensors; the CPU keeps the torch
formulas, the exactness reference).

- ``rms_norm_cuda(x, weight, eps)``: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the
  last dim, computed in float32, rounded where the torch formula rounds;
- ``norm_rope_cuda(x, positions, theta, weight, eps, inv_freq, mscale)``: ``x [T, heads, D]``, optionally
  RMS-normed per head with ``weight [D]``, then rotated by halves (NEOX) at ``positions [T]``; the angle
  ``position / theta**(2i/D)`` in float32 (``position * inv_freq[i]`` for a scaled RoPE such as YaRN),
  cos/sin (times ``mscale``) rounded to ``x.dtype`` as the torch path does.

Tolerance against the torch formulas: float32 within a relative 1e-6 (rsqrt, cos/sin ulps); bf16
within one rounding (tests/test_kernels_cuda.py).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from strata_core.ops.qdecode import HAS_TRITON, on_device

__all__ = ["HAS_TRITON", "norm_rope_cuda", "rms_norm_cuda", "rope_frequencies"]

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # accurate cosf / sinf (angles reach 32K radians)

    @triton.jit
    def _rms_norm_kernel(x, w, out, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        v = tl.load(x + row * D + offs, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        y = (v * r).to(out.dtype.element_ty).to(tl.float32)
        wt = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out + row * D + offs, (wt * y).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_halves(a, b, w, p, eps, theta, log2_theta, freq, mscale, dt: tl.constexpr, D: tl.constexpr,
                          HALF: tl.constexpr, NORM: tl.constexpr, FREQ: tl.constexpr, LIBDEVICE: tl.constexpr):
        """One head's halves ``a``, ``b`` (float32 ``[HALF]``) RMS-normed with ``w`` (if ``NORM``), rounded
        to ``dt`` as the torch formula rounds, then rotated at position ``p``: float32 ``(a', b')``. With
        ``FREQ`` the angles' frequencies are the float32 ``freq [HALF]`` (a scaled RoPE such as YaRN) instead
        of ``theta``'s; cos and sin are multiplied by ``mscale`` before their rounding (1.0: no change)."""
        i = tl.arange(0, HALF)
        if NORM:
            r = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / D + eps)
            a = (tl.load(w + i).to(tl.float32) * (a * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            b = (tl.load(w + HALF + i).to(tl.float32) * (b * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if FREQ:
            inv_freq = tl.load(freq + i)
        elif LIBDEVICE:  # IEEE divisions, powf / cosf / sinf: what torch's CUDA kernels compute
            exponent = libdevice.div_rn((2 * i).to(tl.float32), tl.full([HALF], D, tl.float32))
            inv_freq = libdevice.div_rn(tl.full([HALF], 1.0, tl.float32),
                                        libdevice.pow(tl.full([HALF], theta, tl.float32), exponent))
        else:
            inv_freq = 1.0 / tl.exp2((2 * i).to(tl.float32) / D * log2_theta)
        angle = p * inv_freq
        if LIBDEVICE:
            c = (libdevice.cos(angle) * mscale).to(dt).to(tl.float32)
            s = (libdevice.sin(angle) * mscale).to(dt).to(tl.float32)
        else:  # the interpreter (TRITON_INTERPRET=1) has no libdevice
            c = (tl.cos(angle) * mscale).to(dt).to(tl.float32)
            s = (tl.sin(angle) * mscale).to(dt).to(tl.float32)
        return a * c - b * s, b * c + a * s

    @triton.jit
    def _norm_rope_kernel(x, w, pos, out, heads, eps, theta, log2_theta, freq, mscale, D: tl.constexpr,
                          HALF: tl.constexpr, NORM: tl.constexpr, FREQ: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # token * heads + head
        i = tl.arange(0, HALF)
        a = tl.load(x + row * D + i).to(tl.float32)
        b = tl.load(x + row * D + HALF + i).to(tl.float32)
        dt = out.dtype.element_ty
        p = tl.load(pos + row // heads).to(tl.float32)
        a, b = _norm_rope_halves(a, b, w, p, eps, theta, log2_theta, freq, mscale, dt, D, HALF, NORM, FREQ, LIBDEVICE)
        tl.store(out + row * D + i, a.to(dt))
        tl.store(out + row * D + HALF + i, b.to(dt))

    def rms_norm_cuda(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm of ``x [..., D]`` (contiguous) over the last dim, in ``x.dtype``."""
        D = x.shape[-1]
        x = x.contiguous()
        out = torch.empty_like(x)
        rows = x.numel() // D
        if rows:
            with on_device(x.device):  # Triton launches on the current device
                _rms_norm_kernel[(rows,)](x, weight, out, D, eps, BLOCK=triton.next_power_of_2(D),
                                          num_warps=4 if D >= 1024 else 1)
        return out

    def norm_rope_cuda(x: Tensor, positions: Tensor, theta: float, weight: Tensor | None = None,
                       eps: float = 0.0, inv_freq: Tensor | None = None, mscale: float = 1.0) -> Tensor:
        """``x [T, heads, D]`` optionally RMS-normed per head, then NEOX-rotated at ``positions [T]``
        (``inv_freq`` float32 ``[D / 2]`` and ``mscale``: a scaled RoPE, as ``rope_cos_sin`` takes them)."""
        T, heads, D = x.shape
        x, positions = x.contiguous(), positions.contiguous()
        out = torch.empty_like(x)
        if T:
            with on_device(x.device):
                _norm_rope_kernel[(T * heads,)](
                    x, weight if weight is not None else x, positions, out, heads, eps, float(theta),
                    math.log2(theta), rope_frequencies(inv_freq, x), float(mscale), D=D, HALF=D // 2,
                    NORM=weight is not None, FREQ=inv_freq is not None,
                    LIBDEVICE=os.environ.get("TRITON_INTERPRET") != "1", num_warps=1)
        return out

    def rope_frequencies(inv_freq: Tensor | None, like: Tensor) -> Tensor:
        """The kernels' frequency argument: ``inv_freq`` as contiguous float32 on ``like``'s device, or
        ``like`` itself where there is none (a pointer the kernel does not read)."""
        if inv_freq is None:
            return like
        if inv_freq.dtype != torch.float32 or inv_freq.device != like.device:
            raise ValueError(f"a scaled RoPE's frequencies must be float32 on {like.device}, got {inv_freq.dtype} "
                             f"on {inv_freq.device}")
        return inv_freq.contiguous()

else:
    rms_norm_cuda = norm_rope_cuda = rope_frequencies = None  # type: ignore[assignment]
