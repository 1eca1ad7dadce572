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
    # YaRN from a short original context, so that the ramp between kept and divided angles falls inside
    # the head's pairs and the attention factor is well away from 1
    "qwen3moe-yarn": ("qwen3moe", dict(max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32))),
    "qwen3moe-linear": ("qwen3moe", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
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


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
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


def test_rope_scaling_comes_from_the_file_and_changes_the_logits(tmp_path):
    """The YaRN keys land in the spec (and ``strata info``'s lines); the same weights without them give
    other logits, so the scaled case above is not plain RoPE by accident; an unknown type is refused."""
    hf = tiny_hf_model("qwen3moe", seed=3, **CASES["qwen3moe-yarn"][1])
    write_gguf(hf, tmp_path / "yarn.gguf")
    _, yarn, rows = load(tmp_path / "yarn.gguf")
    scale = yarn.spec.rope_scale
    assert (scale.kind, scale.factor, scale.orig_ctx) == ("yarn", 8.0, 32) and scale.mscale > 1.2
    assert yarn.spec.info_lines() == ["RoPE yarn x8 (original context 32)"]
    plain = tiny_hf_model("qwen3moe", seed=3, max_position_embeddings=256)
    plain.load_state_dict(hf.state_dict())
    write_gguf(plain, tmp_path / "plain.gguf")
    _, unscaled, rows_plain = load(tmp_path / "plain.gguf")
    assert unscaled.spec.rope_scale is None
    assert (run(yarn, rows) - run(unscaled, rows_plain)).abs().max() > 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_yarn_on_cuda_matches_the_cpu(tmp_path):
    """A YaRN model on CUDA (its RoPE through the torch formulas, decode not fused): the logits of a
    prompt and of decode windows are the CPU's, both in float32 (in bf16 this tiny model's routing flips:
    bf16 against float32 differs by up to 1.0 on the CPU alone, scaled RoPE or not)."""
    from strata_core.engine import Engine

    write_gguf(tiny_hf_model("qwen3moe", seed=3, **CASES["qwen3moe-yarn"][1]), tmp_path / "yarn.gguf")
    tokens = TOKENS.tolist()
    results = []
    for devices in (["cpu"], ["cuda:0"]):
        engine = Engine.load(tmp_path / "yarn.gguf", devices=devices, max_context=64, dtype="float32")
        try:
            session = engine.new_session()
            prompt = engine.prefill(session, tokens[:16], all_logits=True).cpu()
            steps = [engine.decode_window([(session, t)])[0].cpu() for t in tokens[16:]]
            results.append(torch.cat([prompt, torch.stack(steps)]))
        finally:
            engine.close()
    assert (results[0] - results[1]).abs().max() <= 1e-2
