"""Gated DeltaNet building blocks: the causal depthwise convolution and the gated delta rule, each
carrying its session state (updated in place).

Two forms of the delta rule compute the same function:

- ``delta_rule_recurrent``: one token after the other, the same ops of the same shapes for every
  token; on the CPU a token's output and the state after it are therefore bit-identical whatever
  the prompt chunk or decode batch it came in (the CPU reference, and every decode step);
- ``delta_rule_chunked``: the chunked (WY / UT-transform) form of transformers'
  ``torch_chunk_gated_delta_rule``, a few matmuls per 64-token chunk; what a CUDA prompt runs when
  flash-linear-attention (``fla-core``, an optional dependency) is not installed. With it,
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (Triton) computes the same.

Shapes: ``q, k [T, Hv, Dk]`` (L2-normed, already repeated to the value heads), ``v [T, Hv, Dv]``,
``g`` (log decay, <= 0) and ``beta [T, Hv]``, the state ``[Hv, Dk, Dv]`` float32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from strata_core.ops.matmul import batch_invariant

__all__ = ["CHUNK", "causal_conv", "delta_rule", "delta_rule_chunked", "delta_rule_recurrent", "fla_chunk",
           "l2_norm"]

log = logging.getLogger(__name__)

#: tokens per chunk of the chunked form (transformers' and fla's default)
CHUNK = 64

@functools.cache
def fla_chunk() -> Callable[..., Any] | None:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` if flash-linear-attention (``fla-core``,
    an optional dependency: ``pip install strata[fla]``) imports, else None (imported on first use)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        log.info("gated deltanet prompts: fla-core is not installed, the torch chunked form runs")
        return None
    log.info("gated deltanet prompts: fla-core's chunk_gated_delta_rule")
    return chunk_gated_delta_rule


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                steps: list[torch.Tensor] | None = None) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of ``x [T, C]`` after the ``K - 1`` earlier inputs in
    ``state [K - 1, C]`` (float32) with ``weight [C, K]``: ``[T, C]`` in x's dtype; ``state`` then
    holds the last ``K - 1`` inputs. Each output is summed over the taps in one fixed order. ``steps``
    (a list) is given the state after each token."""
    T, K = x.shape[0], weight.shape[1]
    window = torch.cat([state, x.float()])  # [K - 1 + T, C]
    if steps is not None:
        steps.extend(window[t + 1:t + K] for t in range(T))
    w = weight.float()
    out = window[0:T] * w[:, 0]
    for j in range(1, K):
        out = out + window[j:j + T] * w[:, j]  # [T, C]
    state.copy_(window[T:])
    return batch_invariant(F.silu, out).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32 (llama.cpp's ``build_gdn_l2_norm``)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor,
                         steps: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The gated delta rule token by token: ``[T, Hv, Dv]`` float32 outputs; ``state`` updated in place;
    ``steps`` (a list) is given the state after each token.

    Per token: ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q / sqrt(Dk)``."""
    T, Dk = q.shape[0], q.shape[-1]
    q = (q.float() * Dk ** -0.5).contiguous()
    k, v = k.float().contiguous(), v.float().contiguous()
    decay = batch_invariant(torch.exp, g.float())  # [T, Hv]
    beta = beta.float().contiguous()
    s = state
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, Hv, Dv]
    for t in range(T):
        s = s * decay[t][:, None, None]  # [Hv, Dk, Dv]
        kt = k[t][:, :, None]  # [Hv, Dk, 1]
        delta = (v[t] - (s * kt).sum(1)) * beta[t][:, None]  # [Hv, Dv]
        s = s + kt * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(1)
        if steps is not None:
            steps.append(s)  # a new tensor each token: kept as it is
    state.copy_(s)
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule in chunks of ``chunk`` tokens (the UT transform within a chunk, the state
    carried between chunks): ``[T, Hv, Dv]`` float32 outputs; ``state`` updated in place."""
    T, H, Dk = q.shape
    pad = (-T) % chunk
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q * Dk ** -0.5, k, v))  # [H, T', D]
    g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, T']
    n = (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, x.shape[-1]) for x in (q, k, v))  # [H, n, C, D]
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [H, n, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # strictly lower part: the UT system
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C] causal, diagonal included
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [H, n, C, Dv]
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                              unitriangular=True)  # [H, n, C, Dk]
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = state
    out = []
    for i in range(n):
        v_new = values[:, i] - k_decayed[:, i] @ s  # [H, C, Dv]
        out.append(q[:, i] @ s + intra[:, i] @ v_new)
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return torch.cat(out, dim=1)[:, :T].transpose(0, 1)  # [T, H, Dv]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, k_heads: int, chunked: str = "fla",
               steps: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The gated delta rule for ``q, k [T, Hk, Dk]`` (one key head per ``Hv / Hk`` value heads),
    ``v [T, Hv, Dv]``: ``[T, Hv, Dv]`` float32; ``state`` updated in place.

    The recurrent form on the CPU, for single tokens and where ``steps`` (a list) is to be given the state
    after each token (a speculative window's rows); a prompt off the CPU runs the form ``chunked``
    names (``ForwardKernels.deltanet_chunked``): "fla" (fla's kernel when installed, else
    ``delta_rule_chunked``), "torch" (``delta_rule_chunked``) or "recurrent" (token by token)."""
    if chunked not in ("fla", "torch", "recurrent"):
        raise ValueError(f"delta_rule: chunked {chunked!r} is not 'fla', 'torch' or 'recurrent'")
    rep = v.shape[1] // k_heads
    if q.device.type == "cpu" or q.shape[0] == 1 or chunked == "recurrent" or steps is not None:
        return delta_rule_recurrent(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta, state,
                                    steps)
    kernel = fla_chunk() if chunked == "fla" else None
    if kernel is None:
        return delta_rule_chunked(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta, state)
    dtype = v.dtype  # the kernel reads [B, T, H, D] rows contiguous; it repeats the key heads itself
    out, final = kernel(q[None].to(dtype).contiguous(), k[None].to(dtype).contiguous(), v[None].contiguous(),
                        g[None].float().contiguous(), beta[None].to(dtype).contiguous(), scale=q.shape[-1] ** -0.5,
                        initial_state=state[None], output_final_state=True)
    state.copy_(final[0])
    return out[0].float()
