"""The Qwen3-Next forward (``Qwen3NextModel``): Gated DeltaNet layers and gated full-attention layers
over ``MoEModel``'s experts, head and attention kernels (math: architecture.py).

A Gated DeltaNet layer reads and updates its session state in place (``kv.state(layer, "conv")``,
``kv.state(layer, "ssm")``); ``positions`` and ``n_ctx`` do not enter it: the state is the
session's whole past. On the CPU every token goes through the same ops of the same shapes (the
recurrent delta rule, a per-tap convolution, batch-invariant projections), so logits are
bit-identical across prompt chunk sizes and decode batches.
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

    attention_spans = MoEModel.attention_per_span  # its attention is one piece per session

    def attention(self, layer: int, h: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                  n_ctx: int | None = None, static: bool = False) -> torch.Tensor:
        """``h + mixer(rms_norm(h))``: the layer's Gated DeltaNet or gated attention (see
        ``MoEModel.attention`` for ``positions``, ``n_ctx`` and ``static``)."""
        x = rms_norm(h, self.weights.at(layer, h.device)["attn_norm.weight"], self.spec.rms_norm_eps,
                     self.kernels.fused_norms)  # [T, H]
        if self.spec.recurrent[layer]:
            return h + self.linear_attention(layer, x, kv)
        return h + self.gated_attention(layer, x, positions.to(h.device), kv, n_ctx, static)

    def gated_attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                        n_ctx: int | None, static: bool) -> torch.Tensor:
        """``[T, H]``: attention of normed ``x [T, H]`` multiplied by ``sigmoid(gate)`` before the output
        projection; writes the layer's K/V."""
        s, w = self.spec, self.weights.at(layer, x.device)
        T, D = x.shape[0], s.head_dim
        qg = linear(x, w["attn_q.weight"]).view(T, s.n_heads, 2 * D)  # [T, nh, 2D]: query | gate
        q, gate = qg[..., :D].contiguous(), qg[..., D:].reshape(T, s.q_size)
        k = linear(x, w["attn_k.weight"]).view(T, s.n_kv_heads, D)  # [T, nkv, D]
        v = linear(x, w["attn_v.weight"]).view(T, s.n_kv_heads, D)  # [T, nkv, D]
        q = rms_norm(q, w["attn_q_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
        k = rms_norm(k, w["attn_k_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
        q, k = self.rope(layer, q, k, positions)
        kv.write(layer, positions, k=k, v=v)
        out = self.attend(layer, q, positions, kv, n_ctx, static)  # [T, nh*D]
        return linear(out * batch_invariant(torch.sigmoid, gate), w["attn_output.weight"])  # [T, H]

    def rope(self, layer: int, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NEOX RoPE over the first ``rope_dim`` dims of each head; the rest passes through."""
        r = self.spec.rope_dim
        cos, sin = rope_cos_sin(positions, r, self.spec.rope_theta, *self.rope_tables(q.device, r))  # [T, r]
        return tuple(torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1) for x in (q, k))

    def linear_attention(self, layer: int, x: torch.Tensor, kv: KVCache) -> torch.Tensor:
        """``[T, H]``: the Gated DeltaNet of normed ``x [T, H]`` continuing the layer's conv and ssm state;
        the states after each row kept in ``kv`` while it keeps a window's steps (``KVCache.keep_steps``)."""
        s, w = self.spec, self.weights.at(layer, x.device)
        T, Dh, Hk, Hv = x.shape[0], s.gdn_head_dim, s.gdn_k_heads, s.gdn_v_heads
        r = Hv // Hk
        conv_steps, ssm_steps = ([], []) if kv.keeps_steps else (None, None)
        qkv = causal_conv(linear(x, w["attn_qkv.weight"]), kv.state(layer, "conv"),
                          w["ssm_conv1d.weight"], conv_steps)  # [T, 2 Hk Dh + Hv Dh]
        q, k, v = qkv.split((s.gdn_key_dim, s.gdn_key_dim, s.gdn_value_dim), dim=-1)
        q = l2_norm(q.reshape(T, Hk, Dh), s.rms_norm_eps)  # [T, Hk, Dh]
        k = l2_norm(k.reshape(T, Hk, Dh), s.rms_norm_eps)
        ba = linear(x, w["ssm_ba.weight"]).view(T, Hk, 2 * r).float()  # per key head: [beta x r, alpha x r]
        beta = batch_invariant(torch.sigmoid, ba[..., :r].reshape(T, Hv))  # [T, Hv]
        g = batch_invariant(F.softplus, ba[..., r:].reshape(T, Hv) + w["ssm_dt.bias"].float())
        g = g * w["ssm_a"].float()  # [T, Hv]
        o = delta_rule(q, k, v.reshape(T, Hv, Dh), g, beta, kv.state(layer, "ssm"), Hk,
                       self.kernels.deltanet_chunked, ssm_steps)  # [T, Hv, Dh] f32
        for conv, ssm in zip(conv_steps or (), ssm_steps or ()):
            kv.keep_step(layer, {"conv": conv, "ssm": ssm})
        z = linear(x, w["attn_gate.weight"]).view(T, Hv, Dh)  # [T, Hv, Dh]
        o = (rms_norm(o.to(x.dtype), w["ssm_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)
             * batch_invariant(F.silu, z.float()).to(x.dtype))
        return linear(o.reshape(T, s.gdn_value_dim), w["ssm_out.weight"])  # [T, H]
