"""``Architecture``: how one llama.cpp architecture's GGUF metadata and tensors map to a ModelSpec.

The class covers the llama.cpp "attention + routed MoE (+ optional shared expert)" family with
llama.cpp's tensor names. An architecture that differs only in options is an instance with other
flags (see qwen3moe.py, qwen2moe.py); one with other tensors subclasses and overrides
``layer_tensors`` / ``spec_from_metadata``.

Defaults applied when metadata lacks a key follow llama.cpp's loader (``llama_model::load_hparams``):
- ``attention.head_count_kv`` -> ``attention.head_count``
- ``attention.key_length`` (head_dim) -> ``embedding_length / head_count``
- ``rope.freq_base`` -> 10000.0
- ``expert_feed_forward_length`` -> ``feed_forward_length / expert_used_count``
- ``expert_weights_scale`` -> 0 (llama.cpp: 0 or 1 means no scaling)
- ``expert_weights_norm`` -> the architecture's graph default (``Architecture.norm_topk_default``)
- ``context_length`` -> 0 if absent (llama.cpp requires it; we only report it)
- vocab size -> rows of ``token_embd.weight``
Unsupported: per-layer head counts or expert sizes that differ between layers, RoPE scaling
(``rope.scaling.type`` other than "none"), and ``rope.dimension_count`` != head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.spec import ModelSpec

__all__ = ["Architecture"]

Shape = tuple[int, ...]


def _uniform(value: Any, key: str, path: str) -> Any:
    """A per-layer array key with one value for every layer, as a scalar."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedError(f"{path}: {key} differs between layers ({value}); not supported")
        return value[0]
    return value


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture: its name, forward options and expected tensors."""

    name: str
    has_qk_norm: bool  # attn_q_norm / attn_k_norm (RMSNorm over head_dim, before RoPE)
    has_attn_bias: bool  # attn_{q,k,v}.bias
    has_shared_expert: bool  # ffn_{gate,up,down}_shexp + sigmoid gate ffn_gate_inp_shexp
    norm_topk_default: bool  # llama.cpp graph's norm_w when expert_weights_norm is absent
    output_optional: bool  # output.weight may be absent (tied to token_embd)

    # -- metadata -------------------------------------------------------------------------------
    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> ModelSpec:
        """Build the ModelSpec from GGUF metadata (with llama.cpp's defaults) and tensor shapes."""
        a = self.name

        def get(key: str, default: Any = ...) -> Any:
            full = key.format(arch=a)
            if full in metadata:
                return _uniform(metadata[full], full, path)
            if default is ...:
                raise ModelFileError(f"{path}: metadata key {full!r} is missing")
            return default

        hidden = int(get(K.LLM.EMBEDDING_LENGTH))
        n_heads = int(get(K.Attention.HEAD_COUNT))
        n_kv = int(get(K.Attention.HEAD_COUNT_KV, n_heads))
        head_dim = int(get(K.Attention.KEY_LENGTH, hidden // n_heads))
        if int(get(K.Attention.VALUE_LENGTH, head_dim)) != head_dim:
            raise UnsupportedError(f"{path}: {a}.attention.value_length differs from key_length")
        if int(get(K.Rope.DIMENSION_COUNT, head_dim)) != head_dim:
            raise UnsupportedError(f"{path}: partial RoPE ({a}.rope.dimension_count != head_dim) is not supported")
        if str(get(K.Rope.SCALING_TYPE, "none")) not in ("none", "linear") or \
                float(get(K.Rope.SCALING_FACTOR, 0.0)) not in (0.0, 1.0):
            raise UnsupportedError(f"{path}: RoPE scaling ({a}.rope.scaling.*) is not supported")
        n_experts = int(get(K.LLM.EXPERT_COUNT))
        n_used = int(get(K.LLM.EXPERT_USED_COUNT))
        if n_experts <= 0 or not 0 < n_used <= n_experts:
            raise ModelFileError(f"{path}: bad expert counts ({n_experts} experts, {n_used} used)")
        ffn = get(K.LLM.FEED_FORWARD_LENGTH, None)
        default_ff_exp = int(ffn) // n_used if ffn is not None else ...
        ff_exp = int(get(K.LLM.EXPERT_FEED_FORWARD_LENGTH, default_ff_exp))
        shexp = 0
        if self.has_shared_expert:
            shexp = int(get(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, ffn if ffn is not None else ...))
        scale = float(get(K.LLM.EXPERT_WEIGHTS_SCALE, 0.0))
        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(f"{path}: tensor 'token_embd.weight' is missing")
        if "output.weight" not in tensors and not self.output_optional:
            raise ModelFileError(f"{path}: tensor 'output.weight' is missing")
        return ModelSpec(
            architecture=a,
            n_layers=int(get(K.LLM.BLOCK_COUNT)),
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_size=ff_exp,
            shared_expert_ffn_size=shexp,
            vocab_size=int(embd.shape[0]),
            context_length=int(get(K.LLM.CONTEXT_LENGTH, 0)),
            rope_theta=float(get(K.Rope.FREQ_BASE, 10000.0)),
            rms_norm_eps=float(get(K.Attention.LAYERNORM_RMS_EPS)),
            norm_topk_prob=bool(get(K.LLM.EXPERT_WEIGHTS_NORM, self.norm_topk_default)),
            expert_weights_scale=scale if scale != 0.0 else 1.0,
            has_qk_norm=self.has_qk_norm,
            has_attn_bias=self.has_attn_bias,
            tied_embeddings="output.weight" not in tensors,
        )

    # -- tensors --------------------------------------------------------------------------------
    def global_tensors(self, spec: ModelSpec) -> dict[str, Shape]:
        """Non-layer tensors the forward reads: name -> torch-order shape."""
        out = {"token_embd.weight": (spec.vocab_size, spec.hidden_size),
               "output_norm.weight": (spec.hidden_size,)}
        if not spec.tied_embeddings:
            out["output.weight"] = (spec.vocab_size, spec.hidden_size)
        return out

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """Dense tensors of ``layer`` (attention, norms, router, shared expert): name -> shape."""
        H, p = spec.hidden_size, f"blk.{layer}."
        out = {
            p + "attn_norm.weight": (H,),
            p + "attn_q.weight": (spec.q_size, H),
            p + "attn_k.weight": (spec.kv_size, H),
            p + "attn_v.weight": (spec.kv_size, H),
            p + "attn_output.weight": (H, spec.q_size),
            p + "ffn_norm.weight": (H,),
            p + "ffn_gate_inp.weight": (spec.n_experts, H),
        }
        if self.has_attn_bias:
            out |= {p + "attn_q.bias": (spec.q_size,), p + "attn_k.bias": (spec.kv_size,),
                    p + "attn_v.bias": (spec.kv_size,)}
        if self.has_qk_norm:
            out |= {p + "attn_q_norm.weight": (spec.head_dim,), p + "attn_k_norm.weight": (spec.head_dim,)}
        if self.has_shared_expert:
            F = spec.shared_expert_ffn_size
            out |= {p + "ffn_gate_inp_shexp.weight": (H,), p + "ffn_gate_shexp.weight": (F, H),
                    p + "ffn_up_shexp.weight": (F, H), p + "ffn_down_shexp.weight": (H, F)}
        return out

    def expert_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """The routed-expert tensors of ``layer`` in (gate, up, down) order: name -> shape."""
        E, F, H, p = spec.n_experts, spec.expert_ffn_size, spec.hidden_size, f"blk.{layer}."
        return {p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
                p + "ffn_down_exps.weight": (E, H, F)}

    def validate(self, gguf_file: Any, spec: ModelSpec) -> None:
        """Check every tensor the forward reads exists with the right shape and a supported type."""
        names = dict(self.global_tensors(spec))
        for layer in range(spec.n_layers):
            names |= self.layer_tensors(spec, layer) | self.expert_tensors(spec, layer)
        for name, shape in names.items():
            gguf_file.tensor(name, shape)
