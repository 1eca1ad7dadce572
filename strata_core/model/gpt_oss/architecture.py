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

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.model.architecture import Architecture
from strata_core.model.gpt_oss.forward import GptOssModel
from strata_core.model.gpt_oss.spec import GptOssSpec
from strata_core.model.metadata import Metadata

__all__ = ["ARCH", "GptOssArchitecture"]


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

    def read_rope_scaling(self, m: Metadata, path: str) -> None:
        """gpt-oss reads its RoPE scaling into its own fields (``spec_from_metadata``)."""

    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> GptOssSpec:
        """The base spec plus the sliding window, its layers and the RoPE scaling."""
        base = super().spec_from_metadata(metadata, tensors, path)
        m = Metadata(metadata, self.name, path)
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


ARCH = GptOssArchitecture(name="gpt-oss", has_qk_norm=False, has_attn_bias=True, has_shared_expert=False,
                          norm_topk_default=False, output_optional=False,
                          forward=GptOssModel)
