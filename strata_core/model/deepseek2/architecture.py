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

from typing import Any, Mapping

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.model.architecture import Architecture
from strata_core.model.deepseek2.forward import DeepseekModel
from strata_core.model.deepseek2.spec import DeepseekSpec
from strata_core.model.metadata import Metadata

__all__ = ["ARCH", "DeepseekArchitecture"]

_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # llama_expert_gating_func_type (0: not set)


class DeepseekArchitecture(Architecture):
    """The deepseek2 tensors and metadata (see the module docstring)."""

    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> DeepseekSpec:
        """Build the ``DeepseekSpec`` with llama.cpp's defaults."""
        a = self.name
        m = Metadata(metadata, a, path)
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


ARCH = DeepseekArchitecture(name="deepseek2", has_qk_norm=False, has_attn_bias=False, has_shared_expert=True,
                            norm_topk_default=False, output_optional=True,
                            forward=DeepseekModel)
