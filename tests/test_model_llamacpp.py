"""A GGUF written by llama.cpp's own converter (committed fixture, see tools/make_llamacpp_fixture.py)
loads in Strata and gives the same logits as transformers on the committed HF weights."""

from __future__ import annotations

from pathlib import Path

import torch

from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.kvcache import KVCache
from strata_core.model.registry import load_model

DATA = Path(__file__).parent / "data" / "qwen3moe_llamacpp"


def test_llamacpp_gguf_matches_transformers():
    from transformers import Qwen3MoeForCausalLM

    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    spec = model.spec
    assert (spec.architecture, spec.n_layers, spec.head_dim, spec.n_experts) == ("qwen3moe", 2, 16, 8)
    assert spec.norm_topk_prob  # llama.cpp's qwen3moe graph always renormalises; the key is absent
    assert "qwen3moe.expert_weights_norm" not in f.metadata
    hf = Qwen3MoeForCausalLM.from_pretrained(DATA, attn_implementation="eager", dtype=torch.float32).eval()
    assert hf.config.norm_topk_prob
    tokens = torch.randint(0, spec.vocab_size, (16,), generator=torch.Generator().manual_seed(0))  # [T]
    with torch.no_grad():
        ours = model.forward(tokens, KVCache.for_spec(spec, 32), DequantExpertRows(ExpertWeights(f, spec)))
        ref = hf(tokens[None]).logits[0]  # [T, V]
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4
