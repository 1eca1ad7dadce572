"""The Qwen3-Next forward (``Qwen3NextModel``): Gated DeltaNet layers and gated full-attention layers
over ``MoEModel``'s experts, head and attention kernels (math: architecture.py).

A Gated DeltaNet layer reads and updates its session state in place (``kv.state(layer, "conv")``,
``kv.state(layer, "ssm")``); ``positions`` and ``n_ctx`` do not enter it: the state is the
session's whole past. On the CPU every token goes through the same ops of the same shapes (the
recurrent delta rule, a per-tap convolution, batch-invariant projections), so logits are
bit-identical across prompt chunk sizes and decode batches. Several sessions' rows (a decode window, a
prompt batch) take every projection at once, one read of the weights; the convolution and the delta rule,
or the K/V write and the attention, run per session.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata_core.model.qwen3next.deltanet import causal_conv, delta_rule, l2_norm
from strata_core.model.kvcache import KVCache
from strata_core.model.ops import apply_rope, rms_norm, rope_cos_sin
from strata_core.model.qwen3next.spec import Qwen3NextSpec
from strata_core.model.transformer import MoEModel
from strata_core.ops.matmul import batch_invariant, linear

__all__ = ["Qwen3NextModel"]


class Qwen3NextModel(MoEModel):
    """Qwen3-Next over ``DenseWeights`` (``spec`` a ``Qwen3NextSpec``)."""

    spec: Qwen3NextSpec
    ffn_norm = "post_attention_norm.weight"

    def attention_spans(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                        spans: list[tuple[KVCache, int, int, int | None]], static: bool = False) -> torch.Tensor:
        """``h + mixer(rms_norm(h))`` of rows ``[a, b)`` of ``h [T, H]`` for each span ``(kv, a, b, n_ctx)`` (one
        session's rows; see ``MoEModel.attention_spans``): the layer's Gated DeltaNet or gated attention, the
        norm and every projection over all rows at once (row-wise on the CPU), the convolution and delta rule,
        or the K/V write and attention, per session."""
        x = rms_norm(h, self.weights.at(layer, h.device)["attn_norm.weight"], self.spec.rms_norm_eps,
                     self.kernels.fused_norms)  # [T, H]
        if self.spec.recurrent[layer]:
            return h + self.linear_attention(layer, x, spans)
        return h + self.gated_attention(layer, x, positions, spans, static)

    def gated_attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                        spans: list[tuple[KVCache, int, int, int | None]], static: bool) -> torch.Tensor:
        """``[T, H]``: attention of normed ``x [T, H]`` multiplied by ``sigmoid(gate)`` before the output
        projection; writes each span's K/V into its cache."""
        s, w = self.spec, self.weights.at(layer, x.device)
        T, D = x.shape[0], s.head_dim
        qg = linear(x, w["attn_q.weight"]).view(T, s.n_heads, 2 * D)  # [T, nh, 2D]: query | gate
        q, gate = qg[..., :D].contiguous(), qg[..., D:].reshape(T, s.q_size)
        k = linear(x, w["attn_k.weight"]).view(T, s.n_kv_heads, D)  # [T, nkv, D]
        v = linear(x, w["attn_v.weight"]).view(T, s.n_kv_heads, D)  # [T, nkv, D]
        q = rms_norm(q, w["attn_q_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
        k = rms_norm(k, w["attn_k_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
        q, k = self.rope(layer, q, k, positions)
        parts = []
        for kv, a, b, n_ctx in spans:
            kv.write(layer, positions[a:b], k=k[a:b], v=v[a:b])
            parts.append(self.attend(layer, q[a:b], positions[a:b], kv, n_ctx, static))  # [b - a, nh*D]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return linear(out * batch_invariant(torch.sigmoid, gate), w["attn_output.weight"])  # [T, H]

    def rope(self, layer: int, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NEOX RoPE over the first ``rope_dim`` dims of each head; the rest passes through."""
        r = self.spec.rope_dim
        cos, sin = rope_cos_sin(positions, r, self.spec.rope_theta, *self.rope_tables(q.device, r))  # [T, r]
        return tuple(torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1) for x in (q, k))

    def linear_attention(self, layer: int, x: torch.Tensor,
                         spans: list[tuple[KVCache, int, int, int | None]]) -> torch.Tensor:
        """``[T, H]``: the Gated DeltaNet of normed ``x [T, H]``, each span's rows continuing its cache's conv and
        ssm state; the states after each row kept where the cache keeps a window's steps
        (``KVCache.keep_steps``)."""
        s, w = self.spec, self.weights.at(layer, x.device)
        T, Dh, Hk, Hv = x.shape[0], s.gdn_head_dim, s.gdn_k_heads, s.gdn_v_heads
        r = Hv // Hk
        projected = linear(x, w["attn_qkv.weight"])  # [T, 2 Hk Dh + Hv Dh]
        ba = linear(x, w["ssm_ba.weight"]).view(T, Hk, 2 * r).float()  # per key head: [beta x r, alpha x r]
        beta = batch_invariant(torch.sigmoid, ba[..., :r].reshape(T, Hv))  # [T, Hv]
        g = batch_invariant(F.softplus, ba[..., r:].reshape(T, Hv) + w["ssm_dt.bias"].float())
        g = g * w["ssm_a"].float()  # [T, Hv]
        parts = []
        for kv, a, b, _ in spans:
            conv_steps, ssm_steps = ([], []) if kv.keeps_steps else (None, None)
            qkv = causal_conv(projected[a:b], kv.state(layer, "conv"), w["ssm_conv1d.weight"], conv_steps)
            q, k, v = qkv.split((s.gdn_key_dim, s.gdn_key_dim, s.gdn_value_dim), dim=-1)
            q = l2_norm(q.reshape(b - a, Hk, Dh), s.rms_norm_eps)  # [t, Hk, Dh]
            k = l2_norm(k.reshape(b - a, Hk, Dh), s.rms_norm_eps)
            parts.append(delta_rule(q, k, v.reshape(b - a, Hv, Dh), g[a:b], beta[a:b], kv.state(layer, "ssm"), Hk,
                                    self.kernels.deltanet_chunked, ssm_steps))  # [t, Hv, Dh] f32
            for conv, ssm in zip(conv_steps or (), ssm_steps or ()):
                kv.keep_step(layer, {"conv": conv, "ssm": ssm})
        o = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, Hv, Dh]
        z = linear(x, w["attn_gate.weight"]).view(T, Hv, Dh)  # [T, Hv, Dh]
        o = (rms_norm(o.to(x.dtype), w["ssm_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
             * batch_invariant(F.silu, z.float()).to(x.dtype))
        return linear(o.reshape(T, s.gdn_value_dim), w["ssm_out.weight"])  # [T, H]
