"""RoPE scaling as llama.cpp computes it (ggml's ``rope_yarn``), and the interleaved ("normal") rotation.

``scaled_inv_freq`` gives the angle per position of each rotated pair for no scaling, linear scaling
or YaRN (``ggml_rope_yarn_corr_dims`` + ``rope_yarn_ramp`` with ``ext_factor`` 1); what cos and sin
are multiplied by (the effective ``mscale``) is the architecture's business.
``apply_rope_interleaved`` rotates adjacent pairs ``(x0, x1), (x2, x3), ...`` (llama.cpp's
``LLAMA_ROPE_TYPE_NORM``, used by deepseek2; HF's ``apply_rotary_pos_emb_interleave``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata_core.ops.matmul import batch_invariant

__all__ = ["YARN_BETA_FAST", "YARN_BETA_SLOW", "RopeScaling", "apply_rope_interleaved", "scaled_inv_freq",
           "yarn_get_mscale"]

#: llama.cpp's hparams defaults (``yarn_beta_fast`` / ``yarn_beta_slow``), used unless an
#: architecture's loader reads the GGUF keys (deepseek2's does not)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude for a context ``scale`` (llama.cpp's and HF's ``get_mscale``)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def scaled_inv_freq(dim: int, base: float, scaling: str = "none", factor: float = 1.0, orig_ctx: int = 0,
                    beta_fast: float = YARN_BETA_FAST, beta_slow: float = YARN_BETA_SLOW) -> torch.Tensor:
    """``[dim / 2]`` float32 angle per position of each rotated pair.

    :param scaling: "none", "linear" (every angle divided by ``factor``) or "yarn" (high-frequency
        pairs keep their angle, low-frequency ones are divided by ``factor``, a linear ramp between
        the correction dims of ``beta_fast`` and ``beta_slow`` over ``orig_ctx`` positions)
    """
    extrap = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    if scaling == "none" or factor == 1.0:
        return extrap
    interp = extrap / factor
    if scaling == "linear":
        return interp

    def corr_dim(beta: float) -> float:  # ggml_rope_yarn_corr_dim
        return dim * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(dim - 1.0, math.ceil(corr_dim(beta_slow)))
    y = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(0.001, high - low)
    ramp = 1.0 - y.clamp(0.0, 1.0)  # [dim/2]: 1 = extrapolate (high frequencies), 0 = interpolate
    return interp * (1 - ramp) + extrap * ramp


@dataclass(frozen=True)
class RopeScaling:
    """The RoPE scaling a GGUF asks for (``rope.scaling.type`` linear or yarn, ``.factor``,
    ``.original_context_length``, ``.attn_factor``), applied as llama.cpp's ``rope_yarn`` applies it."""

    kind: str  # "linear" or "yarn"
    factor: float
    orig_ctx: int
    attn_factor: float = 1.0

    def inv_freq(self, dim: int, base: float) -> torch.Tensor:
        """``[dim / 2]`` float32 angle per position of each rotated pair."""
        return scaled_inv_freq(dim, base, self.kind, self.factor, self.orig_ctx)

    @property
    def mscale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor times ``attn_factor``)."""
        return self.attn_factor * (yarn_get_mscale(self.factor) if self.kind == "yarn" else 1.0)

    def describe(self) -> str:
        return f"RoPE {self.kind} x{self.factor:g} (original context {self.orig_ctx})"


def apply_rope_interleaved(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           mscale: float = 1.0) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [T, heads, D]`` at ``positions [T]`` by ``inv_freq [D/2]`` (float32
    angles), scaling cos and sin by ``mscale``; returned in ``x``'s dtype."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    cos = batch_invariant(torch.cos, angles)[:, None, :]  # [T, 1, D/2]
    sin = batch_invariant(torch.sin, angles)[:, None, :]
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    pairs = x.float().unflatten(-1, (-1, 2))  # [T, heads, D/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [T, heads, D/2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # [T, heads, D/2, 2]
    return out.flatten(-2).to(x.dtype)  # [T, heads, D]
