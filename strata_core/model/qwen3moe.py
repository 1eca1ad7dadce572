"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k RMSNorm, no attention biases, no shared expert.

llama.cpp semantics (src/models/qwen3moe.cpp): RoPE NEOX style (rotate halves) over the full
head_dim; q/k RMSNorm over head_dim before RoPE; router softmax over all experts, top-k, and the
top-k weights are ALWAYS renormalised (``build_moe_ffn(..., norm_w=true, ...)``) — the HF config's
``norm_topk_prob`` is not written by llama.cpp's converter. Strata honours an explicit
``qwen3moe.expert_weights_norm`` key (written by strata's test writer); absent, it normalises like
llama.cpp. ``output.weight`` may be absent (tied embeddings: the head reuses ``token_embd``).

The forward is the shared ``MoEModel``; ``QWEN3MOE_PRESETS`` are its synthetic shapes (``strata make-synthetic``).
"""

from __future__ import annotations

from strata_core.model.architecture import Architecture
from strata_core.model.preset import Preset
from strata_core.model.transformer import MoEModel

__all__ = ["ARCH", "QWEN3MOE_PRESETS"]

ARCH = Architecture(name="qwen3moe", has_qk_norm=True, has_attn_bias=False, has_shared_expert=False,
                    norm_topk_default=True, output_optional=True, forward=MoEModel)

#: synthetic presets (``strata make-synthetic --preset NAME``): the real models' widths, two small ones
QWEN3MOE_PRESETS: dict[str, Preset] = {
    "qwen3-30b-a3b": Preset(48, 128, 8, 2048, 768, 32, 4, 128, 151936),
    "qwen3-235b-a22b": Preset(94, 128, 8, 4096, 1536, 64, 4, 128, 151936),
    "small": Preset(8, 64, 8, 512, 256, 8, 2, 64, 4096, context=8192),
    "tiny": Preset(2, 16, 4, 256, 256, 4, 2, 64, 512, context=2048),
}
