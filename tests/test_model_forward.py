"""The MoE forward vs HF transformers (eager, float32) on tiny random Qwen3-MoE / Qwen2-MoE models.

Tolerances: F32 files must match HF to 1e-4 (max abs logit diff). For F16 / Q8_0 files the HF
reference is loaded with the file's dequantized weights (``dequantized_hf_state_dict``), so both
sides compute with identical weights and the same 1e-4 bound applies; the remaining difference is
float32 summation order. Against the original (unquantized) HF weights, F16 stays within 2e-2
(routing ties can still flip a top-k choice, hence no bound for Q8_0 there).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.experts.rows import DequantExpertRows, group_by_expert
from strata_core.ops.combine import combine_rows
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import dequantized_hf_state_dict, write_gguf
from strata_core.model.kvcache import KVCache
from strata_core.model.registry import load_model

TOKENS = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(7))  # [T]
CASES = {  # id -> (arch, HF overrides)
    "qwen3moe-norm": ("qwen3moe", dict(norm_topk_prob=True)),
    "qwen3moe-nonorm": ("qwen3moe", dict(norm_topk_prob=False, num_hidden_layers=3, num_experts_per_tok=4,
                                         head_dim=16, tie_word_embeddings=True)),
    "qwen2moe-nonorm": ("qwen2moe", dict(norm_topk_prob=False)),
    "qwen2moe-norm": ("qwen2moe", dict(norm_topk_prob=True, num_key_value_heads=1)),
}


def load(path):
    f = GGUFFile.open(path)
    model = load_model(f)
    return f, model, DequantExpertRows(ExpertWeights(f, model.spec))


def run(model, rows, tokens=TOKENS):
    kv = KVCache.for_spec(model.spec, max_tokens=64)
    with torch.no_grad():
        return model.forward(tokens, kv, rows)  # [T, V]


def hf_logits(hf, tokens=TOKENS):
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()  # [T, V]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = tiny_hf_model(arch, seed=3, **overrides)
    return request.param, hf, tmp_path_factory.mktemp(request.param)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0], ids=lambda q: q.name)
def test_logits_match_hf(case, qtype):
    name, hf, tmp = case
    path = tmp / f"{qtype.name}.gguf"
    write_gguf(hf, path, expert_qtype=qtype, dense_qtype=qtype)
    f, model, rows = load(path)
    assert model.spec.norm_topk_prob == hf.config.norm_topk_prob
    ours = run(model, rows)
    if qtype == Q.F16:
        assert (ours - hf_logits(hf)).abs().max() <= 2e-2
    ref = tiny_hf_model(hf.config.model_type.replace("_", ""), seed=3, **CASES[name][1])
    ref.load_state_dict(dequantized_hf_state_dict(f, ref.state_dict()))
    diff = (ours - hf_logits(ref)).abs().max().item()
    assert diff <= 1e-4, f"{name} {qtype.name}: max abs diff {diff}"
    assert ours.abs().max() > 1.0  # logits are not trivially small


def test_routing_is_not_degenerate(case):
    name, hf, tmp = case
    path = tmp / "route.gguf"
    write_gguf(hf, path)
    _, model, _ = load(path)
    h = model.embed(TOKENS)
    kv = KVCache.for_spec(model.spec, 64)
    positions = torch.arange(len(TOKENS))
    for layer in range(model.spec.n_layers):
        h = model.attention(layer, h, positions, kv)
        x = torch.nn.functional.rms_norm(h, (h.shape[-1],), model.weights.at(layer, "cpu")["ffn_norm.weight"],
                                         model.spec.rms_norm_eps)
        ids, weights = model.route(layer, x)
        assert ids.unique().numel() >= 5, f"layer {layer} routes to only {ids.unique().tolist()}"
        if model.spec.norm_topk_prob:
            torch.testing.assert_close(weights.sum(-1), torch.ones(len(TOKENS)))
        else:
            assert (weights.sum(-1) - 1).abs().max() > 1e-2
        h = model.moe(layer, h, DequantExpertRows(ExpertWeights(GGUFFile.open(path), model.spec)))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_incremental_decode_matches_full_prefill(arch, tmp_path):
    path = tmp_path / "decode.gguf"
    write_gguf(tiny_hf_model(arch, seed=5), path)
    _, model, rows = load(path)
    tokens = TOKENS[:12]
    full = run(model, rows, tokens)  # [T, V]
    kv = KVCache.for_spec(model.spec, max_tokens=64)
    with torch.no_grad():
        parts = [model.forward(tokens[:9], kv, rows)]
        parts += [model.forward(tokens[i:i + 1], kv, rows) for i in range(9, len(tokens))]
    assert kv.n_tokens == len(tokens)
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=0)


def test_expert_rows_combine_in_fixed_order():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])  # [T, k]
    order, experts, counts = group_by_expert(ids)
    assert experts.tolist() == [0, 1, 2, 3] and counts.tolist() == [1, 2, 1, 2]
    assert ids.reshape(-1)[order].tolist() == [0, 1, 1, 2, 3, 3]
    rows = torch.randn(3, 2, 5)  # [T, k, H]
    w = torch.rand(3, 2)
    torch.testing.assert_close(combine_rows(rows, w), rows[:, 0] * w[:, :1] + rows[:, 1] * w[:, 1:])
