"""Tiny random HF Qwen MoE models for tests and fixtures (seeded, float32, eager attention).

Weights are re-initialised at scales that give O(1) activations and logits and a router whose
top-k differs between tokens, so a test comparing logits can fail (HF's default std=0.02 would make
every logit ~0). Norm weights are ``1 + noise`` so a missing norm is visible.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["tiny_config", "tiny_hf_model"]


def tiny_config(arch: str, **overrides: Any):
    """An HF config for a tiny ``arch`` ("qwen3moe" or "qwen2moe") model; ``overrides`` win."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attn_implementation="eager")
    if arch == "qwen3moe":
        return Qwen3MoeConfig(**(common | dict(head_dim=32, norm_topk_prob=True) | overrides))
    if arch == "qwen2moe":
        return Qwen2MoeConfig(**(common | dict(shared_expert_intermediate_size=64, norm_topk_prob=False)
                                 | overrides))
    raise ValueError(f"no tiny config for {arch!r}")


@torch.no_grad()
def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded tiny HF ``arch`` ForCausalLM in float32 eval mode with non-degenerate weights."""
    from transformers import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    cfg = tiny_config(arch, **overrides)
    cls = Qwen3MoeForCausalLM if arch == "qwen3moe" else Qwen2MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:  # biases
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1]
            gain = 2.0 if name.endswith("mlp.gate.weight") else 1.0  # sharper router
            p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model
