"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, no q/k norm, one shared expert.

llama.cpp semantics (src/models/qwen2moe.cpp): RoPE NEOX style over the full head_dim; router
softmax over all experts, top-k, weights NOT renormalised (``norm_w=false``; Strata honours an
explicit ``qwen2moe.expert_weights_norm`` key if a file carries one); the shared expert is a SiLU
gated FFN (``ffn_{gate,up,down}_shexp``) scaled by ``sigmoid(ffn_gate_inp_shexp . x)`` and added to
the routed output. ``expert_shared_feed_forward_length`` defaults to ``feed_forward_length``.
``output.weight`` is required.
"""

from __future__ import annotations

from strata_core.model.architecture import Architecture
from strata_core.model.transformer import MoEModel

__all__ = ["ARCH"]

ARCH = Architecture(name="qwen2moe", has_qk_norm=False, has_attn_bias=True, has_shared_expert=True,
                    norm_topk_default=False, output_optional=False, forward=MoEModel)
