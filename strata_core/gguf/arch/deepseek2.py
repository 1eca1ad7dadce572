"""deepseek2 (DeepSeek-V2/V2-Lite/V2.5/V3/R1, Kimi-K2): multi-head latent attention, leading dense layers.

llama.cpp semantics (src/models/deepseek2.cpp, ``llama_model_deepseek2::load_arch_hparams``):

- Attention is MLA. q = ``attn_q_b(rms_norm(attn_q_a x))`` (q LoRA, ``attention.q_lora_rank``) or
  ``attn_q x`` when the file has no ``attn_q_a`` (V2-Lite), split per head into a "nope" part
  (``key_length_mla - rope.dimension_count``) and a rope part. ``attn_kv_a_mqa x`` gives the
  compressed latent (``attention.kv_lora_rank``, RMS-normed by ``attn_kv_a_norm``) and one shared
  rope key (``rope.dimension_count``). Per head, ``attn_k_b [kv_lora, nope]`` absorbs the nope query
  into latent space and ``attn_v_b [v, kv_lora]`` expands the attended latent into the value
  (``attention.value_length_mla``). Only the latent and the rope key are kept per token. Files from
  converters before that split (one ``attn_kv_b [heads * (nope + v), kv_lora]``, head sizes in
  ``attention.key_length``/``value_length``, no ``*_mla`` keys; llama.cpp then runs its non-MLA graph,
  the same product) are read too: ``attn_k_b``/``attn_v_b`` are views of ``attn_kv_b``.
- RoPE is llama.cpp's "normal" type (adjacent pairs) over the rope part only, with YaRN when
  ``rope.scaling.type`` is yarn (``ext_factor`` 1, beta 32/1 fixed: the GGUF's beta keys are not
  read). The scores are scaled by ``mscale^2 / sqrt(key_length_mla)`` with ``mscale = attn_factor_org
  * (1 + 0.1 * yarn_log_mul * ln(factor))``; ``rope.scaling.yarn_log_multiplier`` is stored as
  ``0.1 * mscale_all_dim`` by the converter and divided by 0.1 at load. cos/sin are scaled so that
  ``mscale == mscale_all_dim`` (what every released config has) gives 1.
- The first ``leading_dense_block_count`` layers have a SiLU-gated dense FFN (``ffn_{gate,up,down}``,
  ``feed_forward_length``) and no experts; the others route over ``expert_count`` experts and add
  ``expert_shared_count`` shared experts (one FFN of ``expert_feed_forward_length * count``, ungated).
- Routing (``build_moe_ffn``): softmax or sigmoid of the router logits per ``expert_gating_func``
  (absent: softmax, as for old V2 files); ``exp_probs_b.bias`` (V3) is added for the selection only;
  with ``expert_group_count`` > 1 the experts are grouped, each group scored by the sum of its two
  best biased probabilities, and only the ``expert_group_used_count`` best groups compete; the
  weights are the unbiased probabilities of the chosen experts, renormalised if
  ``expert_weights_norm`` (default false) and multiplied by ``expert_weights_scale`` (0 or absent:
  none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.arch.base import Architecture, Shape, _Metadata
from strata_core.gguf.spec import ModelSpec, StateTensor

__all__ = ["ARCH", "DeepseekArchitecture", "DeepseekSpec"]

_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # llama_expert_gating_func_type (0: not set)


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
        from strata_core.model.rope import yarn_get_mscale  # the model package imports this one

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


class DeepseekArchitecture(Architecture):
    """The deepseek2 tensors and metadata (see the module docstring)."""

    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> DeepseekSpec:
        """Build the ``DeepseekSpec`` with llama.cpp's defaults."""
        a = self.name
        m = _Metadata(metadata, a, path)
        n_layers = m.int(K.LLM.BLOCK_COUNT)
        hidden = m.int(K.LLM.EMBEDDING_LENGTH)
        n_heads = m.int(K.Attention.HEAD_COUNT)
        split = K.Attention.KEY_LENGTH_MLA.format(arch=a) in metadata  # llama.cpp's is_mla()
        if not split and "blk.0.attn_kv_b.weight" not in tensors:
            raise ModelFileError(f"{path}: {a}.attention.key_length_mla is missing (and there is no attn_kv_b)")
        k_mla = m.int(K.Attention.KEY_LENGTH_MLA if split else K.Attention.KEY_LENGTH)
        v_mla = m.int(K.Attention.VALUE_LENGTH_MLA if split else K.Attention.VALUE_LENGTH)
        rope = m.int(K.Rope.DIMENSION_COUNT)
        if rope % 2 or rope >= k_mla:
            raise ModelFileError(f"{path}: {a}.rope.dimension_count {rope} must be even and below "
                                 f"{a}.attention.key_length_mla {k_mla}")
        kv_lora = m.int(K.Attention.KV_LORA_RANK)
        q_lora = m.int(K.Attention.Q_LORA_RANK) if "blk.0.attn_q_a.weight" in tensors else 0
        n_dense = m.int(K.LLM.LEADING_DENSE_BLOCK_COUNT, 0, minimum=0)
        if n_dense >= n_layers:
            raise UnsupportedError(f"{path}: {a}.leading_dense_block_count {n_dense} leaves no MoE layer of "
                                   f"{n_layers} (a dense model)")
        n_experts = m.int(K.LLM.EXPERT_COUNT)
        n_used = m.int(K.LLM.EXPERT_USED_COUNT)
        if n_used > n_experts:
            raise ModelFileError(f"{path}: bad expert counts: {a}.expert_used_count {n_used} > "
                                 f"{a}.expert_count {n_experts}")
        groups = m.int(K.LLM.EXPERT_GROUP_COUNT, 1, minimum=0) or 1
        groups_used = m.int(K.LLM.EXPERT_GROUP_USED_COUNT, groups, minimum=0) or groups
        if groups > 1 and (n_experts % groups or groups_used > groups or groups_used * n_experts // groups < n_used
                           or n_experts // groups < 2):
            raise ModelFileError(f"{path}: {a}.expert_group_count {groups} / expert_group_used_count "
                                 f"{groups_used} do not fit {n_experts} experts with {n_used} used")
        ff_exp = m.int(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
        n_shared = m.int(K.LLM.EXPERT_SHARED_COUNT, 0, minimum=0)
        gating_id = m.int(K.LLM.EXPERT_GATING_FUNC, 0, minimum=0)
        if gating_id not in _GATING:
            raise UnsupportedError(f"{path}: {a}.expert_gating_func {gating_id} is not supported "
                                   f"(1 softmax, 2 sigmoid)")
        scaling = m.str(K.Rope.SCALING_TYPE, "linear")  # llama.cpp's default when absent
        factor = m.float(K.Rope.SCALING_FACTOR, 0.0, positive=False) or 1.0
        if scaling not in ("none", "linear", "yarn"):
            raise UnsupportedError(f"{path}: {a}.rope.scaling.type {scaling!r} is not supported (none, linear, yarn)")
        context = m.int(K.LLM.CONTEXT_LENGTH)
        scale = m.float(K.LLM.EXPERT_WEIGHTS_SCALE, 0.0, positive=False, below=1e3)
        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(f"{path}: tensor 'token_embd.weight' is missing")
        return DeepseekSpec(
            architecture=a, n_layers=n_layers, hidden_size=hidden, n_heads=n_heads, n_kv_heads=1,
            head_dim=k_mla, n_experts=n_experts, n_experts_used=n_used, expert_ffn_size=ff_exp,
            shared_expert_ffn_size=ff_exp * n_shared, vocab_size=int(embd.shape[0]), context_length=context,
            rope_theta=m.float(K.Rope.FREQ_BASE, 10000.0),
            rms_norm_eps=m.float(K.Attention.LAYERNORM_RMS_EPS, below=1.0),
            norm_topk_prob=m.bool(K.LLM.EXPERT_WEIGHTS_NORM, False),
            expert_weights_scale=scale if scale != 0.0 else 1.0,
            has_qk_norm=False, has_attn_bias=False, tied_embeddings="output.weight" not in tensors,
            q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_dim=k_mla - rope, qk_rope_dim=rope,
            v_head_dim=v_mla, split_kv_b=split, n_dense_lead=n_dense,
            dense_ffn_size=m.int(K.LLM.FEED_FORWARD_LENGTH) if n_dense else 0,
            gating=_GATING[gating_id], has_probs_bias=f"blk.{n_layers - 1}.exp_probs_b.bias" in tensors,
            expert_groups=groups, expert_groups_used=groups_used,
            rope_scaling="none" if factor == 1.0 else scaling, rope_factor=factor,
            rope_orig_ctx=m.int(K.Rope.SCALING_ORIG_CTX_LEN, context),
            rope_attn_factor=m.float(K.Rope.SCALING_ATTN_FACTOR, 1.0),
            yarn_log_mul=m.float(K.Rope.SCALING_YARN_LOG_MUL, 0.0, positive=False) / 0.1,
        )

    def model(self, spec: ModelSpec, dense: Any) -> Any:
        """The MLA forward (``DeepseekModel``)."""
        from strata_core.model.deepseek2 import DeepseekModel  # the model package imports this one

        return DeepseekModel(spec, dense)

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """Attention (MLA), norms, and the dense FFN or the router (+ correction bias) and shared experts."""
        assert isinstance(spec, DeepseekSpec)
        H, nh, p = spec.hidden_size, spec.n_heads, f"blk.{layer}."
        out = {p + "attn_norm.weight": (H,),
               p + "attn_kv_a_mqa.weight": (spec.kv_lora_rank + spec.qk_rope_dim, H),
               p + "attn_kv_a_norm.weight": (spec.kv_lora_rank,),
               p + "attn_output.weight": (H, nh * spec.v_head_dim),
               p + "ffn_norm.weight": (H,)}
        if spec.split_kv_b:
            out |= {p + "attn_k_b.weight": (nh, spec.kv_lora_rank, spec.qk_nope_dim),
                    p + "attn_v_b.weight": (nh, spec.v_head_dim, spec.kv_lora_rank)}
        else:
            out[p + "attn_kv_b.weight"] = (nh * (spec.qk_nope_dim + spec.v_head_dim), spec.kv_lora_rank)
        if spec.q_lora_rank:
            out |= {p + "attn_q_a.weight": (spec.q_lora_rank, H), p + "attn_q_a_norm.weight": (spec.q_lora_rank,),
                    p + "attn_q_b.weight": (nh * spec.head_dim, spec.q_lora_rank)}
        else:
            out[p + "attn_q.weight"] = (nh * spec.head_dim, H)
        if layer not in spec.moe_layers:
            F = spec.dense_ffn_size
            return out | {p + "ffn_gate.weight": (F, H), p + "ffn_up.weight": (F, H), p + "ffn_down.weight": (H, F)}
        out[p + "ffn_gate_inp.weight"] = (spec.n_experts, H)
        if spec.has_probs_bias:
            out[p + "exp_probs_b.bias"] = (spec.n_experts,)
        if spec.has_shared_expert:
            F = spec.shared_expert_ffn_size
            out |= {p + "ffn_gate_shexp.weight": (F, H), p + "ffn_up_shexp.weight": (F, H),
                    p + "ffn_down_shexp.weight": (H, F)}
        return out

    def expert_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """The routed experts of an MoE layer; none for a leading dense layer."""
        return super().expert_tensors(spec, layer) if layer in spec.moe_layers else {}


ARCH = DeepseekArchitecture(name="deepseek2", has_qk_norm=False, has_attn_bias=False, has_shared_expert=True,
                            norm_topk_default=False, output_optional=True)
