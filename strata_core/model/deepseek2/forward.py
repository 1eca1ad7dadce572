"""``DeepseekModel``: the deepseek2 forward (llama.cpp's src/models/deepseek2.cpp; the
semantics: architecture.py).

What differs from ``MoEModel``: multi-head latent attention whose session state per layer is the
normed latent and the rotated rope key of each position (``DeepseekSpec.layer_state``), never the
expanded K/V; the leading dense-FFN layers; the shared experts (ungated); the router (softmax or
sigmoid, selection bias, group-limited top-k).

Attention has two exact forms of the same product:

- *absorbed* (what llama.cpp runs): each head's nope query is taken into latent space through
  ``attn_k_b``, the scores are one MQA product of ``[q_absorbed, q_rope]`` with ``[latent, rope]``
  over the cached positions, the attended latent goes through ``attn_v_b``. The cache is read
  once for all heads; the torch form has the scores ``[heads, T, S]`` in memory; it serves the CPU (always, over
  the whole cache: logits bit-identical across chunk and batch sizes), decode windows and captured
  graphs (``static``: the whole capacity, masked on the device). Its attention over the cache is the
  ``strata::mla_attention`` op (strata_core/ops/mla.py): on the CPU the torch form, on CUDA a Triton
  flash-decoding kernel that reads the latent and rope rows in place (the setting ``mla_kernel``; off:
  ``mla_reference``, the torch form).
- *expanded* (prompt chunks on a GPU): per-head keys ``[latent attn_k_b, rope]`` and values
  ``latent attn_v_b`` of the chunk's visible positions go through torch's fused SDPA (values padded
  to the key width so the flash kernel takes them), so no ``[heads, T, S]`` scores are in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata_core.experts.rows import ExpertRows
from strata_core.model.deepseek2.spec import DeepseekSpec
from strata_core.model.kernels import ForwardKernels
from strata_core.model.kvcache import KVCache
from strata_core.model.kvquant import QuantizedRows
from strata_core.model.ops import rms_norm
from strata_core.model.rope import apply_rope_interleaved, scaled_inv_freq
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights
from strata_core.ops.matmul import batch_invariant, linear, matmul
from strata_core.ops.mla import mla_attention, mla_blocked, mla_reference

__all__ = ["DeepseekModel", "swiglu"]

#: chunks of more query rows than this use the expanded form on a GPU (fused SDPA)
ABSORBED_MAX_ROWS = 64
def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SiLU-gated FFN ``down(silu(gate x) * up x)`` of ``x [T, H]`` (dense weights)."""
    return linear(batch_invariant(F.silu, linear(x, gate)) * linear(x, up), down)


class DeepseekModel(MoEModel):
    """deepseek2 over ``DenseWeights`` (``spec`` a ``DeepseekSpec``)."""

    spec: DeepseekSpec
    splits_heads = False  # MLA: its own ``attention`` runs every head here

    def __init__(self, spec: DeepseekSpec, weights: DenseWeights, kernels: ForwardKernels = ForwardKernels()):
        super().__init__(spec, weights, kernels)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # [rope/2] per device

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, rope]`` rotated (interleaved pairs, the spec's YaRN tables and mscale)."""
        s = self.spec
        if positions.device not in self._inv_freq:  # made once per device, before any graph capture reads it
            self._inv_freq[positions.device] = scaled_inv_freq(
                s.qk_rope_dim, s.rope_theta, s.rope_scaling, s.rope_factor, s.rope_orig_ctx).to(positions.device)
        return apply_rope_interleaved(x, positions, self._inv_freq[positions.device], s.rope_mscale)

    def attention_spans(self, layer: int, h: torch.Tensor, positions: torch.Tensor,
                        spans: list[tuple[KVCache, int, int, int | None]], static: bool = False) -> torch.Tensor:
        """``h + mla(rms_norm(h))`` of rows ``[a, b)`` of ``h [T, H]`` for each span ``(kv, a, b, n_ctx)`` (one
        session's rows; ``n_ctx`` and ``static`` as in ``MoEModel.attention``): the norm, the projections and RoPE
        over all rows at once (row-wise on the CPU), each span's latent and rope key written into its cache and
        its attention over them."""
        s, w = self.spec, self.weights.at(layer, h.device)
        T, eps, C = h.shape[0], s.rms_norm_eps, s.kv_lora_rank
        x = rms_norm(h, w["attn_norm.weight"], eps, self.kernels.fused_norms)  # [T, H]
        if s.q_lora_rank:
            q_a = rms_norm(linear(x, w["attn_q_a.weight"]), w["attn_q_a_norm.weight"], eps, self.kernels.fused_norms)
            q = linear(q_a, w["attn_q_b.weight"])  # [T, nh*Dk]
        else:
            q = linear(x, w["attn_q.weight"])  # [T, nh*Dk]
        q = q.view(T, s.n_heads, s.head_dim)  # [T, nh, Dk]
        compressed = linear(x, w["attn_kv_a_mqa.weight"])  # [T, C + r]
        latent = rms_norm(compressed[:, :C].contiguous(), w["attn_kv_a_norm.weight"], eps,
                          self.kernels.fused_norms)  # [T, C]
        q_nope = q[..., :s.qk_nope_dim]  # [T, nh, nope]
        q_rope = self._rope(q[..., s.qk_nope_dim:], positions)  # [T, nh, r]
        k_rope = self._rope(compressed[:, None, C:], positions)[:, 0]  # [T, r]
        parts = []
        for kv, a, b, n_ctx in spans:
            kv.write(layer, positions[a:b], latent=latent[a:b], rope=k_rope[a:b])
            parts.append(self._attend(layer, w, q_nope[a:b], q_rope[a:b], positions[a:b], kv, n_ctx, static))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, nh, v]
        return h + linear(out.reshape(T, s.n_heads * s.v_head_dim), w["attn_output.weight"])  # [T, H]

    def _attend(self, layer: int, w: dict[str, torch.Tensor], q_nope: torch.Tensor, q_rope: torch.Tensor,
                positions: torch.Tensor, kv: KVCache, n_ctx: int | None, static: bool) -> torch.Tensor:
        """``[t, nh, v]``: one session's rows attending over its cached latents and rope keys, in the absorbed
        form (the CPU, a captured window, a few rows, a quantized cache) or the expanded one (a prompt chunk)."""
        T, on_cpu = q_nope.shape[0], q_nope.device.type == "cpu"
        if on_cpu or static:
            n_ctx = kv.max_tokens
        elif n_ctx is None:
            n_ctx = int(positions.max()) + 1
        if kv.kv_format is not None:  # quantized (kvquant.py): dequantized a key block at a time
            context = self.masked_context(q_nope, positions, kv, n_ctx, static)
            return self._absorbed(w, q_nope, q_rope, positions, kv.read(layer, context, "latent", "rope"))
        if on_cpu or static or T <= ABSORBED_MAX_ROWS or not self.kernels.device_sdpa:
            return self._absorbed(w, q_nope, q_rope, positions, kv.read(layer, n_ctx, "latent", "rope"))
        return self._expanded(w, q_nope, q_rope, kv.read(layer, n_ctx, "latent", "rope"))

    def _kv_b(self, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``k_b [nh, C, nope]`` and ``v_b [nh, v, C]`` (views of an older file's ``attn_kv_b``)."""
        if "attn_kv_b.weight" not in w:
            return w["attn_k_b.weight"], w["attn_v_b.weight"]
        s = self.spec
        kv_b = w["attn_kv_b.weight"].view(s.n_heads, s.qk_nope_dim + s.v_head_dim, s.kv_lora_rank)
        return kv_b[:, :s.qk_nope_dim].transpose(1, 2), kv_b[:, s.qk_nope_dim:]

    def _absorbed(self, w: dict[str, torch.Tensor], q_nope: torch.Tensor, q_rope: torch.Tensor,
                  positions: torch.Tensor, cached: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[T, nh, v]``: MQA over the latent cache (``cached``: latent ``[S, C]``, rope ``[S, r]``; or both
        ``QuantizedRows``: ``mla_blocked``), causal by ``positions``."""
        k_b, v_b = self._kv_b(w)
        q_abs = matmul(q_nope.transpose(0, 1), k_b.transpose(1, 2))  # [nh, T, C]
        if isinstance(cached[0], QuantizedRows):
            attended = mla_blocked(q_abs, q_rope.transpose(0, 1), *cached, positions, self.spec.kq_scale)
            return matmul(attended, v_b.transpose(1, 2)).transpose(0, 1)  # [T, nh, v]
        latent, rope = (t.to(q_nope.dtype) for t in cached)
        attend = mla_attention if self.kernels.mla_kernel else mla_reference  # ForwardKernels.mla_kernel
        attended = attend(q_abs, q_rope.transpose(0, 1), latent, rope, positions, self.spec.kq_scale)  # [nh, T, C]
        return matmul(attended, v_b.transpose(1, 2)).transpose(0, 1)  # [T, nh, v]

    def _expanded(self, w: dict[str, torch.Tensor], q_nope: torch.Tensor, q_rope: torch.Tensor,
                  cached: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[T, nh, v]``: per-head K/V of the ``S`` visible positions through fused SDPA (the chunk's
        queries are the last ``T`` of them)."""
        s = self.spec
        latent, rope = (t.to(q_nope.dtype) for t in cached)
        S, T, nh = latent.shape[0], q_nope.shape[0], s.n_heads
        k_b, v_b = self._kv_b(w)
        k_nope = matmul(latent, k_b)  # [nh, S, nope]
        keys = torch.cat((k_nope, rope[None].expand(nh, S, s.qk_rope_dim)), dim=-1)  # [nh, S, Dk]
        values = matmul(latent, v_b.transpose(1, 2))  # [nh, S, v]
        values = F.pad(values, (0, max(0, s.head_dim - s.v_head_dim)))  # [nh, S, max(Dk, v)]
        query = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)  # [nh, T, Dk]
        mask = {"is_causal": True} if T == S else {"attn_mask": causal_lower_right(T, S)}
        out = F.scaled_dot_product_attention(query[None], keys[None], values[None], scale=s.kq_scale, **mask)
        return out[0, :, :, :s.v_head_dim].transpose(0, 1)  # [T, nh, v]

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [T, k], weights [T, k])`` as llama.cpp's ``build_moe_ffn`` for deepseek2."""
        s, w = self.spec, self.weights.at(layer, x.device)
        logits = linear(x, w["ffn_gate_inp.weight"]).float()  # [T, E]
        probs = (torch.softmax(logits, dim=-1) if s.gating == "softmax"
                 else batch_invariant(torch.sigmoid, logits))  # [T, E]
        choice = probs + w["exp_probs_b.bias"].float() if s.has_probs_bias else probs  # [T, E]
        if s.expert_groups > 1:
            T, G = choice.shape[0], s.expert_groups
            grouped = choice.view(T, G, -1)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            best = group_scores.topk(s.expert_groups_used, dim=-1).indices  # [T, Gu]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, best, False)  # [T, G]
            choice = grouped.masked_fill(dropped[..., None], float("-inf")).view(T, -1)  # [T, E]
        ids = choice.topk(s.n_experts_used, dim=-1).indices  # [T, k]
        return ids, self.finish_weights(probs.gather(1, ids)).to(x.dtype)  # [T, k], [T, k]

    def moe(self, layer: int, h: torch.Tensor, expert_rows: ExpertRows) -> torch.Tensor:
        """``h + ffn(rms_norm(h))``: the dense FFN of a leading layer, else routed + shared experts."""
        s, w = self.spec, self.weights.at(layer, h.device)
        x = rms_norm(h, w["ffn_norm.weight"], s.rms_norm_eps, self.kernels.fused_norms)  # [T, H]
        if layer not in s.moe_layers:
            return h + swiglu(x, w["ffn_gate.weight"], w["ffn_up.weight"], w["ffn_down.weight"])
        ids, weights = self.route(layer, x)  # [T, k], [T, k]
        out = expert_rows(layer, x, ids, weights)  # [T, H]
        if s.has_shared_expert:
            out = out + swiglu(x, w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"])
        return h + out
