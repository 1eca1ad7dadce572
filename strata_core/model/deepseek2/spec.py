"""``DeepseekSpec``: deepseek2's numbers (MLA's ranks and head parts, the dense lead, the router,
RoPE scaling), its per-token state (the latent and the rope key) and its tensors; see
architecture.py for how llama.cpp reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata_core.model.rope import yarn_get_mscale
from strata_core.model.spec import ModelSpec, Shape, StateTensor

__all__ = ["DeepseekSpec"]


@dataclass(frozen=True)
class DeepseekSpec(ModelSpec):
    """``ModelSpec`` plus MLA's ranks and head parts, the dense lead, the router and RoPE scaling.

    ``head_dim`` is the key head size (``qk_nope_dim + qk_rope_dim``), ``n_kv_heads`` 1 (the latent
    is shared by every head), ``shared_expert_ffn_size`` the shared experts' total width.
    """

    q_lora_rank: int  # 0: q = attn_q x (no q LoRA)
    kv_lora_rank: int  # the latent's width
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    split_kv_b: bool  # attn_k_b + attn_v_b (current converters); False: one attn_kv_b (older files)
    n_dense_lead: int  # leading layers with a dense FFN instead of experts
    dense_ffn_size: int  # their FFN width
    gating: str  # "softmax" or "sigmoid"
    has_probs_bias: bool  # exp_probs_b.bias: a per-expert bias added for the selection only (V3)
    expert_groups: int  # 1: no group-limited routing
    expert_groups_used: int
    rope_scaling: str  # "none", "linear" or "yarn"
    rope_factor: float
    rope_orig_ctx: int
    rope_attn_factor: float  # rope.scaling.attn_factor
    yarn_log_mul: float  # mscale_all_dim (0: none)

    def layer_state(self, layer: int) -> dict[str, StateTensor]:
        """Per token: the normed latent ``[kv_lora_rank]`` and the rotated rope key ``[qk_rope_dim]``."""
        return {"latent": StateTensor((self.kv_lora_rank,)), "rope": StateTensor((self.qk_rope_dim,))}

    @property
    def moe_layers(self) -> range:
        """The layers with routed experts (after the dense lead)."""
        return range(self.n_dense_lead, self.n_layers)

    @property
    def _attn_factor(self) -> float:
        """llama.cpp's ``cparams.yarn_attn_factor`` for this file (llama_context's constructor)."""
        factor = self.rope_factor
        if self.rope_scaling != "yarn":
            return self.rope_attn_factor
        if self.yarn_log_mul != 0.0:
            mscale = self.yarn_log_mul if self.yarn_log_mul != 1.0 else 1.0  # the deepseek2 special case
            attn = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, self.yarn_log_mul)
        else:
            attn = yarn_get_mscale(factor, 1.0)
        return attn / (1.0 + 0.1 * math.log(factor)) * self.rope_attn_factor

    @property
    def rope_mscale(self) -> float:
        """What cos and sin are multiplied by (ggml's ``rope_yarn`` mscale)."""
        if self.rope_scaling != "yarn":
            return self._attn_factor
        return self._attn_factor * (1.0 + 0.1 * math.log(self.rope_factor))

    @property
    def kq_scale(self) -> float:
        """The attention score scale (deepseek2.cpp's ``kq_scale``)."""
        attn_factor_org = self._attn_factor * (1.0 + 0.1 * math.log(self.rope_factor))
        mscale = attn_factor_org * (1.0 + 0.1 * self.yarn_log_mul * math.log(self.rope_factor))
        return mscale * mscale / math.sqrt(self.head_dim)

    def layer_tensors(self, layer: int) -> dict[str, Shape]:
        """Attention (MLA), norms, and the dense FFN or the router (+ correction bias) and shared experts."""
        H, nh, p = self.hidden_size, self.n_heads, f"blk.{layer}."
        out = {p + "attn_norm.weight": (H,),
               p + "attn_kv_a_mqa.weight": (self.kv_lora_rank + self.qk_rope_dim, H),
               p + "attn_kv_a_norm.weight": (self.kv_lora_rank,),
               p + "attn_output.weight": (H, nh * self.v_head_dim),
               p + "ffn_norm.weight": (H,)}
        if self.split_kv_b:
            out |= {p + "attn_k_b.weight": (nh, self.kv_lora_rank, self.qk_nope_dim),
                    p + "attn_v_b.weight": (nh, self.v_head_dim, self.kv_lora_rank)}
        else:
            out[p + "attn_kv_b.weight"] = (nh * (self.qk_nope_dim + self.v_head_dim), self.kv_lora_rank)
        if self.q_lora_rank:
            out |= {p + "attn_q_a.weight": (self.q_lora_rank, H), p + "attn_q_a_norm.weight": (self.q_lora_rank,),
                    p + "attn_q_b.weight": (nh * self.head_dim, self.q_lora_rank)}
        else:
            out[p + "attn_q.weight"] = (nh * self.head_dim, H)
        if layer not in self.moe_layers:
            F = self.dense_ffn_size
            return out | {p + "ffn_gate.weight": (F, H), p + "ffn_up.weight": (F, H), p + "ffn_down.weight": (H, F)}
        out[p + "ffn_gate_inp.weight"] = (self.n_experts, H)
        if self.has_probs_bias:
            out[p + "exp_probs_b.bias"] = (self.n_experts,)
        if self.has_shared_expert:
            F = self.shared_expert_ffn_size
            out |= {p + "ffn_gate_shexp.weight": (F, H), p + "ffn_up_shexp.weight": (F, H),
                    p + "ffn_down_shexp.weight": (H, F)}
        return out

    def info_lines(self) -> list[str]:
        """The architecture-specific lines of ``strata info``."""
        q = f"q LoRA {self.q_lora_rank}" if self.q_lora_rank else "direct q"
        rope = (f"RoPE {self.rope_scaling} x{self.rope_factor:g} (original context {self.rope_orig_ctx})"
                if self.rope_scaling != "none" else "RoPE unscaled")
        groups = (f", {self.expert_groups_used} of {self.expert_groups} expert groups"
                  if self.expert_groups > 1 else "")
        return [f"MLA: latent {self.kv_lora_rank} + rope key {self.qk_rope_dim} per token and layer "
                f"({self.n_heads} heads of {self.qk_nope_dim}+{self.qk_rope_dim} -> value {self.v_head_dim}; "
                f"{q}); {rope}",
                f"dense FFN layers: {self.n_dense_lead} leading (width {self.dense_ffn_size}); router: "
                f"{self.gating}{groups}, weights x{self.expert_weights_scale:g}"
                f"{' renormalised' if self.norm_topk_prob else ''}"]
