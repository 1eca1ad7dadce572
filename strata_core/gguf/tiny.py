"""Tiny random HF Qwen MoE models for tests and fixtures (seeded, float32, eager attention).

Weights are re-initialised at scales that give O(1) activations and logits and a router whose
top-k differs between tokens, so a test comparing logits can fail (HF's default std=0.02 would make
every logit ~0). Norm weights are ``1 + noise`` (Qwen3-Next's zero-centred norms: ``noise``) so a
missing norm is visible.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["tiny_config", "tiny_hf_model"]


def tiny_config(arch: str, **overrides: Any):
    """An HF config for a tiny ``arch`` ("qwen3moe", "qwen2moe", "qwen3next", "gpt-oss" or one of
    ``DEEPSEEK``) model; ``overrides`` win."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig, Qwen3NextConfig

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attn_implementation="eager")
    if arch == "qwen3moe":
        return Qwen3MoeConfig(**(common | dict(head_dim=32, norm_topk_prob=True) | overrides))
    if arch == "qwen2moe":
        return Qwen2MoeConfig(**(common | dict(shared_expert_intermediate_size=64, norm_topk_prob=False)
                                 | overrides))
    if arch == "qwen3next":  # Gated DeltaNet layers with one gated full-attention layer every 2
        return Qwen3NextConfig(**(common | dict(
            head_dim=16, shared_expert_intermediate_size=32, norm_topk_prob=True, full_attention_interval=2,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4) | overrides))
    if arch in DEEPSEEK:  # MLA, a leading dense-FFN layer, shared expert, YaRN RoPE
        return _deepseek_config(arch, overrides)
    if arch == "gpt-oss":  # sinks, sliding window 4 on layers 0, 2..., YaRN (floored dims, as llama.cpp)
        from transformers import GptOssConfig

        yarn = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    truncate=True, original_max_position_embeddings=4096)
        gpt_oss = dict(num_local_experts=common["num_experts"], intermediate_size=32, head_dim=16,
                       sliding_window=4, rope_parameters=yarn, max_position_embeddings=131072)
        common = {k: v for k, v in common.items() if k not in ("num_experts", "moe_intermediate_size")}
        return GptOssConfig(**(common | gpt_oss | overrides))
    raise ValueError(f"no tiny config for {arch!r}")


#: tiny DeepSeek variants: "deepseek3" (V3/R1/Kimi-K2: q LoRA, sigmoid router with correction bias and
#: group-limited top-k, YaRN) and "deepseek2lite" (V2-Lite: direct q, softmax, greedy top-k, no YaRN)
DEEPSEEK = ("deepseek3", "deepseek2lite")


def _deepseek_config(arch: str, overrides: dict[str, Any]):
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, n_shared_experts=1, intermediate_size=32,
                  max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attn_implementation="eager")
    if arch == "deepseek3":
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096,
                    mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
        return DeepseekV3Config(**(common | dict(
            q_lora_rank=16, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            scoring_func="sigmoid", topk_method="noaux_tc", num_mtp_layers=0, rope_parameters=yarn)
            | overrides))
    return DeepseekV2Config(**(common | dict(
        q_lora_rank=None, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, scoring_func="softmax") | overrides))


@torch.no_grad()
def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded tiny HF ``arch`` ForCausalLM in float32 eval mode with non-degenerate weights."""
    from transformers import (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM, Qwen2MoeForCausalLM,
                              Qwen3MoeForCausalLM, Qwen3NextForCausalLM)

    cfg = tiny_config(arch, **overrides)
    cls = {"qwen3moe": Qwen3MoeForCausalLM, "qwen2moe": Qwen2MoeForCausalLM, "qwen3next": Qwen3NextForCausalLM,
           "deepseek3": DeepseekV3ForCausalLM, "deepseek2lite": DeepseekV2ForCausalLM,
           "gpt-oss": GptOssForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    zero_centred = arch == "qwen3next"  # Qwen3NextRMSNorm scales by 1 + weight (its gated norm by weight)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # Gated DeltaNet decay rates: exp(A_log) in [0.05, 0.5]
            p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=gen).log())
        elif p.ndim == 1 and "norm" in name:
            centre = 0.0 if zero_centred and "linear_attn.norm" not in name else 1.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("sinks"):  # gpt-oss attention sinks: logits of the size of the scores
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.ndim == 1 or name.endswith("_bias"):  # biases (gpt-oss experts': [E, n])
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-2] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and \
                arch == "gpt-oss" else p.shape[-1]  # gpt-oss experts are [E, in, out]
            gain = 2.0 if name.endswith(("mlp.gate.weight", "mlp.router.weight")) else 1.0  # sharper router
            if arch == "gpt-oss" and name.endswith("experts.gate_up_proj"):
                gain = 3.0  # some gate/up values beyond swiglu_oai's clamp at 7
            p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection-only router bias
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model
