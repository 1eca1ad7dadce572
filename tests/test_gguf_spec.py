"""ModelSpec from GGUF metadata, with llama.cpp's defaults where keys are absent."""

from __future__ import annotations

import pytest

from strata_core.errors import UnsupportedError
from strata_core.model.registry import ARCHITECTURES, get_architecture
from strata_core.model.spec import ModelSpec

SHAPES = {"token_embd.weight": type("T", (), {"shape": (256, 64)})()}


def meta(arch: str, **extra) -> dict:
    base = {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, "expert_count": 8,
            "expert_used_count": 2, "feed_forward_length": 128, "attention.layer_norm_rms_epsilon": 1e-6,
            "context_length": 512}
    return {f"{arch}.{k}": v for k, v in (base | extra).items()}


def spec(arch: str, **extra) -> ModelSpec:
    tensors = SHAPES | ({"output.weight": SHAPES["token_embd.weight"]} if arch == "qwen2moe" else {})
    return get_architecture(arch).spec_from_metadata(meta(arch, **extra), tensors, "x.gguf")


def test_llamacpp_defaults_qwen3moe():
    s = spec("qwen3moe")
    assert s.n_kv_heads == 4 and s.head_dim == 16  # head_count_kv -> head_count; key_length -> n_embd/n_head
    assert s.rope_theta == 10000.0 and s.expert_weights_scale == 1.0
    assert s.expert_ffn_size == 64  # feed_forward_length / expert_used_count
    assert s.norm_topk_prob and s.has_qk_norm and not s.has_attn_bias and not s.has_shared_expert
    assert s.tied_embeddings and s.vocab_size == 256


def test_llamacpp_defaults_qwen2moe():
    s = spec("qwen2moe")
    assert not s.norm_topk_prob and s.has_attn_bias and not s.has_qk_norm
    assert s.shared_expert_ffn_size == 128 and s.has_shared_expert  # -> feed_forward_length
    assert not s.tied_embeddings


def test_explicit_keys_win():
    s = spec("qwen3moe", **{"attention.key_length": 32, "attention.value_length": 32,
                            "attention.head_count_kv": [2, 2], "expert_weights_norm": False,
                            "expert_feed_forward_length": 48, "rope.freq_base": 1e6})
    assert (s.head_dim, s.n_kv_heads, s.norm_topk_prob, s.expert_ffn_size, s.rope_theta) == (32, 2, False, 48, 1e6)


@pytest.mark.parametrize("extra, match", [
    ({"attention.head_count_kv": [2, 4]}, "differs between layers"),
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "rope.scaling.type 'longrope'"),
    ({"rope.dimension_count": 8}, "partial RoPE"),
])
def test_unsupported_metadata(extra, match):
    with pytest.raises(UnsupportedError, match=match):
        spec("qwen3moe", **extra)


def test_rope_scaling_keys():
    """YaRN's factor and original context (default: the context length), linear, and none / factor 1."""
    s = spec("qwen3moe", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                            "rope.scaling.original_context_length": 32768})
    assert (s.rope_scale.kind, s.rope_scale.factor, s.rope_scale.orig_ctx) == ("yarn", 4.0, 32768)
    s = spec("qwen3moe", **{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0})
    assert (s.rope_scale.kind, s.rope_scale.orig_ctx) == ("linear", s.context_length)
    assert spec("qwen3moe", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 1.0}).rope_scale is None
    assert spec("qwen3moe").rope_scale is None


def test_registry():
    assert {"qwen3moe", "qwen2moe", "gpt-oss"} <= set(ARCHITECTURES)
    with pytest.raises(UnsupportedError, match="'llama' is not supported"):
        get_architecture("llama")
