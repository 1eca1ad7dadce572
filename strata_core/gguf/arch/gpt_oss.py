"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention sinks, alternating sliding-window / full layers,
YaRN RoPE, biases everywhere, a top-k-then-softmax router and the clamped ``swiglu_oai`` experts.

llama.cpp semantics (src/models/openai-moe.cpp, llama-model.cpp, llama-context.cpp, llama-graph.cpp):

- layer ``il`` is sliding-window when ``attention.sliding_window_pattern`` (a per-layer bool
  array) says so, else with the integer pattern ``n`` (default 2) when ``il % n < n - 1``: layers
  0, 2, 4... slide (``LLAMA_SWA_TYPE_STANDARD``: key position ``p0`` is visible to query ``p1``
  when ``p1 - p0 < sliding_window``); ``attention.sliding_window`` is required;
- RoPE NEOX over the whole head; the sliding layers use ``rope.freq_base_swa`` (default: the
  ``rope.freq_base``); ``rope.scaling.type`` yarn with ``rope.scaling.factor`` and
  ``rope.scaling.original_context_length`` (default ``context_length``): llama.cpp's YaRN with
  ``ext_factor`` 1 and its fixed ``beta_fast`` 32 / ``beta_slow`` 1 (the GGUF's yarn beta keys
  are not read for this architecture), the correction dims floored / ceiled (HF's
  ``truncate: false`` is not honoured by llama.cpp), and cos/sin scaled by
  ``rope.scaling.attn_factor`` (default 1) x ``1 + 0.1 ln(factor)``;
- attention: q/k/v/output biases, scale ``1/sqrt(head_dim)``, one learned sink logit per head
  (``attn_sinks``) in the softmax's denominator;
- ``post_attention_norm`` is the MoE block's norm; router logits carry a bias
  (``ffn_gate_inp.bias``), the top-k is taken on the logits and the softmax runs over the k
  selected (``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``, ``norm_w`` false,
  ``expert_weights_scale`` when present);
- experts: ``ffn_{gate,up,down}_exps`` with per-expert biases and
  ``swiglu_oai(g, u) = min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.arch.base import Architecture, Shape, _Metadata
from strata_core.gguf.spec import ModelSpec

__all__ = ["ARCH", "GptOssArchitecture", "GptOssSpec"]

#: the swiglu_oai constants of llama.cpp's graph (``LLM_FFN_SWIGLU_OAI_MOE``)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    """``ModelSpec`` plus gpt-oss's sliding window and RoPE scaling."""

    sliding_window: int  # tokens a sliding layer's query sees (itself included)
    swa_layers: tuple[bool, ...]  # per layer: sliding-window attention
    rope_theta_swa: float  # RoPE base of the sliding layers
    rope_scaling: str  # "none", "linear" or "yarn"
    rope_factor: float  # context scaling factor (1.0 = none)
    rope_orig_ctx: int  # YaRN's original context length
    rope_attn_factor: float  # rope.scaling.attn_factor

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.swa_layers[layer] else None

    @property
    def rope_mscale(self) -> float:
        """What cos and sin are multiplied by (llama.cpp's effective ``mscale``)."""
        from strata_core.model.rope import yarn_get_mscale  # the model package imports this one

        if self.rope_scaling != "yarn":
            return self.rope_attn_factor
        return self.rope_attn_factor * yarn_get_mscale(self.rope_factor)

    def rope_inv_freq(self, layer: int) -> torch.Tensor:
        """``[head_dim / 2]`` float32 angle per position of each rotated pair of ``layer`` (llama.cpp's
        YaRN with its fixed betas)."""
        from strata_core.model.rope import scaled_inv_freq  # the model package imports this one

        base = self.rope_theta_swa if self.swa_layers[layer] else self.rope_theta
        return scaled_inv_freq(self.head_dim, base, self.rope_scaling, self.rope_factor, self.rope_orig_ctx)

    def info_lines(self) -> list[str]:
        """The architecture-specific lines of ``strata info``."""
        sliding = [i for i, s in enumerate(self.swa_layers) if s]
        rope = (f"RoPE {self.rope_scaling} x{self.rope_factor:g} (original context {self.rope_orig_ctx})"
                if self.rope_scaling != "none" else "RoPE unscaled")
        return [f"sliding window: {self.sliding_window} tokens on {len(sliding)} of {self.n_layers} layers "
                f"({_layer_ranges(sliding)}), the others full attention; attention sinks; {rope}"]


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 2, 4, 6]`` -> ``"0, 2, ..., 6"``; a short list as it is."""
    if len(layers) > 4 and all(b - a == layers[1] - layers[0] for a, b in zip(layers, layers[1:])):
        return f"{layers[0]}, {layers[1]}, ..., {layers[-1]}"
    return ", ".join(map(str, layers)) or "none"


def _swa_layers(metadata: Mapping[str, Any], arch: str, n_layers: int, path: str) -> tuple[bool, ...]:
    """llama.cpp's ``load_swa_pattern(ml, 2)``: a per-layer bool array, or an integer pattern n
    (default 2) making layer il sliding when ``il % n < n - 1`` (n == 0: every layer)."""
    key = K.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)
    value = metadata.get(key, 2)
    if isinstance(value, list):
        if len(value) != n_layers or not all(isinstance(v, bool) for v in value):
            raise ModelFileError(f"{path}: metadata key {key!r} must be {n_layers} booleans, got {value[:8]!r}")
        return tuple(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelFileError(f"{path}: metadata key {key!r} is {value!r}, expected an integer >= 0 or a bool array")
    return tuple(value == 0 or il % value < value - 1 for il in range(n_layers))


@dataclass(frozen=True)
class GptOssArchitecture(Architecture):
    """gpt-oss: the base tensors renamed and extended (see the module doc)."""

    def check_rope_scaling(self, m: _Metadata, path: str) -> None:
        """gpt-oss applies its RoPE scaling (read in ``spec_from_metadata``): nothing to reject."""

    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> GptOssSpec:
        """The base spec plus the sliding window, its layers and the RoPE scaling."""
        base = super().spec_from_metadata(metadata, tensors, path)
        m = _Metadata(metadata, self.name, path)
        scaling = m.str(K.Rope.SCALING_TYPE, "none")
        if scaling not in ("none", "linear", "yarn"):
            raise UnsupportedError(f"{path}: {self.name}.rope.scaling.type {scaling!r} is not supported "
                                   "(none, linear, yarn)")
        factor = m.float(K.Rope.SCALING_FACTOR, 0.0, positive=False)
        return GptOssSpec(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
            sliding_window=m.int(K.Attention.SLIDING_WINDOW),
            swa_layers=_swa_layers(metadata, self.name, base.n_layers, path),
            rope_theta_swa=m.float(K.Rope.FREQ_BASE_SWA, base.rope_theta),
            rope_scaling=scaling,
            rope_factor=factor if factor != 0.0 else 1.0,
            rope_orig_ctx=m.int(K.Rope.SCALING_ORIG_CTX_LEN, base.context_length),
            rope_attn_factor=m.float(K.Rope.SCALING_ATTN_FACTOR, 1.0),
        )

    def model(self, spec: ModelSpec, dense: Any) -> Any:
        """A ``GptOssModel``."""
        from strata_core.model.gpt_oss import GptOssModel  # the model package imports this one

        return GptOssModel(spec, dense)

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """Attention with biases and sinks, ``post_attention_norm``, the biased router and the
        per-expert biases (small dense tensors placed with the layer, indexed by expert id)."""
        H, E, F, p = spec.hidden_size, spec.n_experts, spec.expert_ffn_size, f"blk.{layer}."
        out = super().layer_tensors(spec, layer)
        del out[p + "ffn_norm.weight"]
        return out | {
            p + "post_attention_norm.weight": (H,),
            p + "attn_output.bias": (H,),
            p + "attn_sinks.weight": (spec.n_heads,),
            p + "ffn_gate_inp.bias": (E,),
            p + "ffn_gate_exps.bias": (E, F),
            p + "ffn_up_exps.bias": (E, F),
            p + "ffn_down_exps.bias": (E, H),
        }


ARCH = GptOssArchitecture(name="gpt-oss", has_qk_norm=False, has_attn_bias=True, has_shared_expert=False,
                          norm_topk_default=False, output_optional=False)
