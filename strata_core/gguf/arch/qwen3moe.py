"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k RMSNorm, no attention biases, no shared expert.

llama.cpp semantics (src/models/qwen3moe.cpp): RoPE NEOX style (rotate halves) over the full
head_dim; q/k RMSNorm over head_dim before RoPE; router softmax over all experts, top-k, and the
top-k weights are ALWAYS renormalised (``build_moe_ffn(..., norm_w=true, ...)``) — the HF config's
``norm_topk_prob`` is not written by llama.cpp's converter. Strata honours an explicit
``qwen3moe.expert_weights_norm`` key (written by strata's test writer); absent, it normalises like
llama.cpp. ``output.weight`` may be absent (tied embeddings: the head reuses ``token_embd``).
"""

from strata_core.gguf.arch.base import Architecture

ARCH = Architecture(name="qwen3moe", has_qk_norm=True, has_attn_bias=False, has_shared_expert=False,
                    norm_topk_default=True, output_optional=True)
