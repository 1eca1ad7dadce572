"""``GptOssModel``: the gpt-oss forward (llama.cpp's src/models/openai-moe.cpp; the
semantics: architecture.py).

What differs from ``MoEModel``: RoPE tables from the spec (YaRN, per-layer base), attention with
per-head sinks and a sliding window on alternate layers, the output projection's bias (handled by
the base), ``post_attention_norm`` before the MoE, a biased router whose softmax runs over the
top-k logits, and experts with biases and ``swiglu_oai`` (an ``ExpertFFN`` handed to the rows).

Attention runs as masked products on every device (``masked_attention``: torch's fused SDPA has no
sinks): on the CPU over the whole cache, which keeps logits bit-identical across chunk and batch
sizes; on a GPU over the positions written so far (the whole cache in a captured decode window),
a long prompt chunk in blocks of queries.
"""

from __future__ import annotations

import torch

from strata_core.experts.ffn import ExpertFFN
from strata_core.experts.rows import ExpertRows
from strata_core.model.gpt_oss.spec import GptOssSpec
from strata_core.model.kernels import ForwardKernels
from strata_core.model.kvcache import KVCache
from strata_core.model.ops import apply_rope, masked_attention, rms_norm, rope_cos_sin
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights
from strata_core.ops.matmul import linear

__all__ = ["SCORES_BYTES", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "GptOssModel"]

#: the swiglu_oai constants of llama.cpp's graph (``LLM_FFN_SWIGLU_OAI_MOE``)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0

#: Largest float32 score tensor ``[nh, queries, S]`` one attention call makes.
SCORES_BYTES = 1 << 30


class GptOssModel(MoEModel):
    """gpt-oss over ``DenseWeights`` (``spec`` a ``GptOssSpec``)."""

    spec: GptOssSpec
    splits_heads = False  # its own ``attend`` (sinks, sliding windows) runs every head here

    def __init__(self, spec: GptOssSpec, weights: DenseWeights, kernels: ForwardKernels = ForwardKernels()):
        super().__init__(spec, weights, kernels)
        self._inv_freq: dict[tuple[int, torch.device], torch.Tensor] = {}  # (layer, device) -> [D/2]

    def rope(self, layer: int, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, nh, D]``, ``k [T, nkv, D]`` rotated with the layer's (YaRN-scaled) tables."""
        s = self.spec
        key = (layer, positions.device)
        if key not in self._inv_freq:  # made once per device, before any graph capture reads it
            self._inv_freq[key] = s.rope_inv_freq(layer).to(positions.device)
        cos, sin = rope_cos_sin(positions, s.head_dim, s.rope_theta, self._inv_freq[key], s.rope_mscale)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, kv: KVCache, n_ctx: int | None,
               static: bool) -> torch.Tensor:
        """``[T, nh*D]``: the sinks and the layer's window in the softmax (``masked_attention`` over
        ``masked_context`` positions), in blocks of queries whose float32 scores stay under
        ``SCORES_BYTES`` (a long prompt chunk)."""
        keys, values = kv.read(layer, self.masked_context(q, positions, kv, n_ctx, static))  # [S, nkv, D]
        sinks = self.weights.at(layer, q.device)["attn_sinks.weight"]  # [nh]
        window = self.spec.window(layer)
        T, nh = q.shape[0], q.shape[1]
        block = max(1, SCORES_BYTES // (4 * nh * keys.shape[0]))  # rows are independent: the same bits
        if block >= T:
            return masked_attention(q, keys, values, positions, window, sinks)
        return torch.cat([masked_attention(q[i:i + block], keys, values, positions[i:i + block], window, sinks)
                          for i in range(0, T, block)])  # [T, nh*D]

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [T, k], weights [T, k])``: top-k of the biased logits, softmax over those k."""
        s, w = self.spec, self.weights.at(layer, x.device)
        logits = linear(x, w["ffn_gate_inp.weight"]) + w["ffn_gate_inp.bias"]  # [T, E]
        top, ids = torch.topk(logits.float(), s.n_experts_used, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)  # [T, k]
        if s.expert_weights_scale != 1.0:
            weights = weights * s.expert_weights_scale
        return ids, weights.to(x.dtype)

    def expert_ffn(self, layer: int, device: torch.device) -> ExpertFFN:
        """The layer's expert biases (on ``device``) and swiglu_oai."""
        w = self.weights.at(layer, device)
        return ExpertFFN("swiglu_oai", w["ffn_gate_exps.bias"], w["ffn_up_exps.bias"], w["ffn_down_exps.bias"],
                         alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)

    def moe(self, layer: int, h: torch.Tensor, expert_rows: ExpertRows) -> torch.Tensor:
        """``h + moe(rms_norm(h))`` with ``post_attention_norm`` and the biased experts."""
        x = rms_norm(h, self.weights.at(layer, h.device)["post_attention_norm.weight"], self.spec.rms_norm_eps,
                     self.kernels.fused_norms)
        ids, weights = self.route(layer, x)  # [T, k], [T, k]
        return h + expert_rows(layer, x, ids, weights, self.expert_ffn(layer, h.device))
