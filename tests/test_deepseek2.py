"""deepseek2 (MLA): the GGUF llama.cpp's converter makes of a tiny random HF DeepSeek-V3 (committed
fixture, see tools/make_llamacpp_fixture.py --arch deepseek3) gives transformers' logits at every
position with F32 and the converter's Q8_0 (+F16) tensors; a synthetic deepseek2 with Q4_K experts
gives the logits of transformers on its dequantized weights; the session state is the latent and the
rope key per token; the leading dense layer never reaches the expert paths; layer_split on two
logical CPUs gives single's logits bit for bit."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.engine import Engine
from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.weights import ExpertWeights
from strata_core.model.deepseek2.spec import DeepseekSpec
from strata_core.gguf.reader import GGUFFile
from strata_core.model.kvcache import KVCache
from strata_core.model.registry import load_model
from strata_core.model.transformer import MoEModel
from strata_core.model.deepseek2.forward import DeepseekModel
from strata_core.model.rope import scaled_inv_freq
from strata_core.quant import dequantize

DATA = Path(__file__).parent / "data" / "deepseek3_llamacpp"
T = 16
PROMPT = list(range(3, 27))


def _tokens(spec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (T,), generator=torch.Generator().manual_seed(0))  # [T]


def _logits(model: MoEModel, f: GGUFFile, tokens: torch.Tensor | None = None) -> torch.Tensor:
    tokens = _tokens(model.spec) if tokens is None else tokens
    with torch.no_grad():
        return model.forward(tokens, KVCache.for_spec(model.spec, 32),
                             DequantExpertRows(ExpertWeights(f, model.spec)))  # [T, V]


def hf_state_dict(f: GGUFFile, spec: DeepseekSpec) -> dict[str, torch.Tensor]:
    """The HF DeepseekV3 state dict of a deepseek2 GGUF (dequantized): the inverse of llama.cpp's
    converter (``attn_k_b``/``attn_v_b`` joined back into ``kv_b_proj``, experts stacked)."""
    def load(name: str) -> torch.Tensor:
        ref = f.tensors[name]
        return dequantize(ref.raw(), ref.qtype, ref.shape).float()

    out = {"model.embed_tokens.weight": load("token_embd.weight"), "model.norm.weight": load("output_norm.weight"),
           "lm_head.weight": load("output.weight" if "output.weight" in f.tensors else "token_embd.weight")}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
             "attn_q_b": "self_attn.q_b_proj", "attn_q": "self_attn.q_proj",
             "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_down_exps": "mlp.experts.down_proj",
             "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
             "ffn_down_shexp": "mlp.shared_experts.down_proj"}
    for i in range(spec.n_layers):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        for short, long in names.items():
            if blk + short + ".weight" in f.tensors:
                suffix = "" if short.endswith("_exps") else ".weight"
                out[hf + long + suffix] = load(blk + short + ".weight")
        k_b, v_b = load(blk + "attn_k_b.weight"), load(blk + "attn_v_b.weight")  # [nh, C, nope], [nh, v, C]
        out[hf + "self_attn.kv_b_proj.weight"] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])
        if i in spec.moe_layers:
            out[hf + "mlp.experts.gate_up_proj"] = torch.cat(
                (load(blk + "ffn_gate_exps.weight"), load(blk + "ffn_up_exps.weight")), dim=1)  # [E, 2F, H]
            if spec.has_probs_bias:
                out[hf + "mlp.gate.e_score_correction_bias"] = load(blk + "exp_probs_b.bias")
    return out


def _hf(state: dict[str, torch.Tensor] | None = None, config=None) -> torch.nn.Module:
    from transformers import DeepseekV3ForCausalLM

    if config is None:
        hf = DeepseekV3ForCausalLM.from_pretrained(DATA, attn_implementation="eager", dtype=torch.float32)
    else:
        hf = DeepseekV3ForCausalLM(config).float()
    if state is not None:
        missing, unexpected = hf.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


def test_llamacpp_f32_matches_transformers_and_the_mapping_inverts():
    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    spec = model.spec
    assert isinstance(model, DeepseekModel) and isinstance(spec, DeepseekSpec)
    assert (spec.n_layers, spec.moe_layers, spec.q_lora_rank, spec.kv_lora_rank) == (3, range(1, 3), 16, 32)
    assert (spec.gating, spec.has_probs_bias, spec.expert_groups, spec.expert_groups_used) == ("sigmoid", True, 4, 2)
    assert (spec.rope_scaling, spec.rope_factor, spec.rope_orig_ctx, spec.yarn_log_mul) == (
        "yarn", 4.0, 4096, pytest.approx(1.0))
    assert spec.norm_topk_prob and spec.expert_weights_scale == 2.5
    hf = _hf()
    original = hf.state_dict()
    mapped = hf_state_dict(f, spec)
    assert mapped.keys() == original.keys()
    assert all(torch.equal(mapped[k], original[k]) for k in original)
    with torch.no_grad():
        ref = hf(_tokens(spec)[None]).logits[0]  # [T, V]
    ours = _logits(model, f)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4


def test_llamacpp_q8_0_matches_transformers_on_its_weights():
    f = GGUFFile.open(DATA / "model-q8_0.gguf")
    types = {ref.qtype for ref in f.tensors.values()}
    assert {Q.Q8_0, Q.F16} <= types  # the converter keeps rows of 16 in F16 (attn_k_b, ffn_down_exps)
    model = load_model(f)
    with torch.no_grad():
        ref = _hf(hf_state_dict(f, model.spec))(_tokens(model.spec)[None]).logits[0]  # [T, V]
    assert (_logits(model, f) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("change", [dict(has_probs_bias=False), dict(expert_groups=1), dict(gating="softmax"),
                                    dict(rope_scaling="none"), dict(yarn_log_mul=0.0), dict(norm_topk_prob=False)])
def test_each_routing_and_rope_feature_changes_the_logits(change):
    """The comparisons above would fail without each feature: dropping one moves the logits."""
    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    tokens = torch.arange(T) * 17 % model.spec.vocab_size
    changed = DeepseekModel(dataclasses.replace(model.spec, **change), model.weights)
    assert (_logits(changed, f, tokens) - _logits(model, f, tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("factor, orig, mscale_all_dim, dim", [(40.0, 4096, 1.0, 64), (4.0, 4096, 0.707, 16),
                                                               (40.0, 4096, 0.707, 64)])
def test_yarn_matches_transformers(factor, orig, mscale_all_dim, dim):
    """Frequencies, the cos/sin magnitude and the score scale as transformers' DeepseekV3 computes
    them for mscale == mscale_all_dim (every released config; DeepSeek-V3: factor 40, dim 64)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=factor, original_max_position_embeddings=orig,
                mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim, beta_fast=32, beta_slow=1)
    config = DeepseekV3Config(qk_rope_head_dim=dim, qk_nope_head_dim=128, rope_parameters=rope)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.allclose(scaled_inv_freq(dim, 10000.0, "yarn", factor, orig), inv_freq, rtol=1e-6, atol=0)
    spec = dataclasses.replace(load_model(GGUFFile.open(DATA / "model-f32.gguf")).spec, head_dim=128 + dim,
                               qk_rope_dim=dim, rope_factor=factor, rope_orig_ctx=orig, yarn_log_mul=mscale_all_dim)
    assert spec.rope_mscale == pytest.approx(attention_scaling, rel=1e-6)
    assert spec.kq_scale == pytest.approx(yarn_apply_mscale(rope, (128 + dim) ** -0.5), rel=1e-6)


def test_yarn_without_log_multiplier_scales_the_scores_as_llama_cpp():
    """No ``yarn_log_multiplier``: llama.cpp scales cos/sin and the scores by ``1 + 0.1 ln(factor)``
    (transformers would scale only cos/sin); the file means what llama.cpp makes of it."""
    spec = dataclasses.replace(load_model(GGUFFile.open(DATA / "model-f32.gguf")).spec, yarn_log_mul=0.0)
    mscale = 1 + 0.1 * math.log(spec.rope_factor)
    assert spec.rope_mscale == pytest.approx(mscale)
    assert spec.kq_scale == pytest.approx(mscale * mscale / math.sqrt(spec.head_dim))


def test_the_session_state_is_the_latent_and_the_rope_key():
    spec = load_model(GGUFFile.open(DATA / "model-f32.gguf")).spec
    per_layer = spec.kv_lora_rank + spec.qk_rope_dim  # what llama.cpp's MLA cache holds per token
    assert spec.state_bytes(1, torch.bfloat16) == spec.n_layers * per_layer * 2
    expanded = spec.n_layers * spec.n_heads * (spec.head_dim + spec.v_head_dim) * 2  # K and V per head
    assert spec.state_bytes(1, torch.bfloat16) < expanded
    from strata_core.cli.info import describe

    assert f"KV per token: {spec.n_layers * per_layer * 2} bytes in bf16 (latent [32] + rope [16] x 3 layers)" \
        in describe(DATA / "model-f32.gguf", [24.0], 64)
    kv = KVCache.for_spec(spec, 8)
    assert {n: tuple(t.shape[2:]) for n, t in kv.pool_rows(0).items()} == {"latent": (32,), "rope": (16,)}
    assert [tuple(t.shape) for t in kv.read(0, 8, "latent", "rope")] == [(8, 32), (8, 16)]


@pytest.fixture(scope="module")
def engine():
    return Engine.load(DATA / "model-q8_0.gguf", max_context=64, expert_cache=4)


def test_the_dense_layer_has_no_experts_anywhere(engine):
    """The arena, the caches and the routing counts cover layers 1 and 2 only."""
    backend = engine.experts
    assert backend.arena.formats[0] is None and backend.arena.formats[1] is not None
    for cache in backend.caches.values():
        assert bool((cache.table.host[0] < 0).all()) and int((cache.table.host >= 0).sum()) == 4
    engine.logits(PROMPT[:9])
    counts = backend.usage_profile().counts
    assert counts[0].sum() == 0 and counts[1].sum() == counts[2].sum() == 9 * engine.spec.n_experts_used
    assert backend.usage_profile().tokens >= 9


@pytest.fixture(scope="module")
def reference(engine):
    return engine.logits(PROMPT)


@pytest.mark.parametrize("strategy, cut", [("layer_split", 1), ("prefill_main", 2)])
def test_topologies_equal_single_bit_for_bit(engine, reference, strategy, cut):
    """Cut 1 puts the dense layer alone on the first slot; prefill_main hands the latent state off
    after every prompt segment (checked by --dbg-handoff)."""
    other = Engine.load(DATA / "model-q8_0.gguf", strategy=strategy, devices=["cpu", "cpu"], max_context=64,
                        expert_cache=4, prefill_chunk=7, strategy_options={"split": str(cut)}, dbg_handoff=True)
    assert torch.equal(other.logits(PROMPT), reference)
    assert other.generate(PROMPT, max_tokens=4, temperature=0) == engine.generate(PROMPT, max_tokens=4, temperature=0)


def test_conversation_cache_round_trip_and_rewind(engine, reference):
    """The latent state survives save/restore bit for bit and, being per token, can be cut back."""
    session = engine.new_session()
    engine.prefill(session, PROMPT[:15])
    restored = engine.restore_session(engine.save_session(session))
    for name in ("latent", "rope"):
        assert torch.equal(session.kv.committed(1)[name], restored.kv.committed(1)[name])
    assert torch.equal(engine.prefill(restored, PROMPT[15:], all_logits=True), reference[15:])
    session.truncate(9)
    assert torch.equal(engine.prefill(session, PROMPT[9:], all_logits=True), reference[9:])


def _hf_config(spec: DeepseekSpec):
    """The transformers DeepseekV3Config of a deepseek2 spec (sigmoid router, YaRN, q LoRA)."""
    from transformers import DeepseekV3Config

    rope = dict(rope_type="yarn", rope_theta=spec.rope_theta, factor=spec.rope_factor,
                original_max_position_embeddings=spec.rope_orig_ctx, mscale=spec.yarn_log_mul,
                mscale_all_dim=spec.yarn_log_mul, beta_fast=32, beta_slow=1)
    return DeepseekV3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.dense_ffn_size,
        moe_intermediate_size=spec.expert_ffn_size, num_hidden_layers=spec.n_layers, first_k_dense_replace=spec.n_dense_lead,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_heads,
        n_shared_experts=spec.shared_expert_ffn_size // spec.expert_ffn_size, n_routed_experts=spec.n_experts,
        num_experts_per_tok=spec.n_experts_used, n_group=spec.expert_groups, topk_group=spec.expert_groups_used,
        routed_scaling_factor=spec.expert_weights_scale, norm_topk_prob=spec.norm_topk_prob,
        q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_dim,
        qk_rope_head_dim=spec.qk_rope_dim, v_head_dim=spec.v_head_dim, rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.context_length, rope_parameters=rope, num_mtp_layers=0,
        tie_word_embeddings=False, attn_implementation="eager")


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
def test_synthetic_deepseek_with_q4_k_experts_matches_transformers(tmp_path):
    """``make-synthetic --preset deepseek-tiny``: Q4_K experts, Q8_0 dense, the shapes of
    deepseek-v3-small at test size; transformers on its dequantized weights gives the same logits."""
    from strata_core.tools.synthetic import write_synthetic

    path = tmp_path / "deepseek-tiny.gguf"
    write_synthetic(path, "deepseek-tiny", expert_type=Q.Q4_K, dense_type=Q.Q8_0, progress=False)
    f = GGUFFile.open(path)
    model = load_model(f)
    spec = model.spec
    assert f.tensors["blk.1.ffn_down_exps.weight"].qtype == Q.Q4_K and spec.moe_layers == range(1, 2)
    tokens = torch.arange(T) * 31 % spec.vocab_size
    with torch.no_grad():
        ref = _hf(hf_state_dict(f, spec), _hf_config(spec))(tokens[None]).logits[0]  # [T, V]
    ours = _logits(model, f, tokens)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()


def test_v2_lite_direct_q_and_softmax_router_match_transformers():
    """DeepSeek-V2-Lite's form (committed fixture deepseek2lite_llamacpp): q straight from ``attn_q``
    (no q LoRA), softmax router without groups or bias, weights not renormalised, no YaRN."""
    from transformers import DeepseekV2ForCausalLM

    lite = DATA.parent / "deepseek2lite_llamacpp"
    f = GGUFFile.open(lite / "model-f32.gguf")
    model = load_model(f)
    spec = model.spec
    assert (spec.q_lora_rank, spec.gating, spec.has_probs_bias, spec.expert_groups) == (0, "softmax", False, 1)
    assert (spec.norm_topk_prob, spec.rope_scaling, spec.moe_layers) == (False, "none", range(1, 2))
    hf = DeepseekV2ForCausalLM.from_pretrained(lite, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(_tokens(spec)[None]).logits[0]  # [T, V]
    assert ref.abs().max() > 1.0
    assert (_logits(model, f) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("T, S", [(12, 12), (5, 20)])
def test_expanded_form_equals_absorbed_form(T, S):
    """The GPU's prompt form (per-head K/V through SDPA, values padded) computes what the absorbed
    form computes, for a whole prompt and for a chunk after cached positions."""
    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    s, w = model.spec, model.weights.at(1, "cpu")
    g = torch.Generator().manual_seed(T)
    q_nope = torch.randn(T, s.n_heads, s.qk_nope_dim, generator=g, dtype=torch.float64)
    q_rope = torch.randn(T, s.n_heads, s.qk_rope_dim, generator=g, dtype=torch.float64)
    cached = (torch.randn(S, s.kv_lora_rank, generator=g, dtype=torch.float64),
              torch.randn(S, s.qk_rope_dim, generator=g, dtype=torch.float64))
    w64 = {k: v.double() for k, v in w.items()}
    absorbed = model._absorbed(w64, q_nope, q_rope, torch.arange(S - T, S), cached)  # [T, nh, v]
    expanded = model._expanded(w64, q_nope, q_rope, cached)
    assert absorbed.shape == expanded.shape == (T, s.n_heads, s.v_head_dim)
    assert torch.allclose(absorbed, expanded, rtol=1e-5, atol=1e-6)  # the softmax runs in float32


def test_served_completions_reuse_the_latent_prefix(engine):
    """Through the HTTP API: a second turn reuses the cached latent rows of the first (a per-token state
    can be cut back), and each answer equals the engine's greedy tokens run alone."""
    import openai
    from test_server_support import live_server

    from strata_core.config import StrataSettings

    first = PROMPT[:12]
    second = first + [7, 8, 9]
    settings = StrataSettings(model=DATA / "model-q8_0.gguf", model_alias="ds", max_context=64, parallel=1,
                              conv_cache=2, expert_cache=4)
    with live_server(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answers = [client.completions.create(model="ds", prompt=p, max_tokens=3, temperature=0) for p in (first, second)]
    for prompt, answer in zip((first, second), answers):
        assert answer.choices[0].text == engine.generate(prompt, max_tokens=3, temperature=0)
    assert answers[1].model_extra["timings"]["cache_n"] == len(first)


@pytest.mark.parametrize("changes, error, match", [
    ({"attention.key_length_mla": None}, ModelFileError, "key_length_mla"),
    ({"expert_gating_func": 3}, UnsupportedError, "expert_gating_func"),
    ({"expert_group_count": 3}, ModelFileError, "expert_group_count"),
    ({"leading_dense_block_count": 3}, UnsupportedError, "no MoE layer"),
    ({"rope.dimension_count": 15}, ModelFileError, "dimension_count"),
    ({"attention.kv_lora_rank": None}, ModelFileError, "kv_lora_rank"),
    ({"rope.scaling.type": "longrope"}, UnsupportedError, "scaling.type"),
])
def test_bad_metadata_is_named(changes, error, match):
    from strata_core.model.deepseek2.architecture import ARCH

    f = GGUFFile.open(DATA / "model-f32.gguf")
    meta = dict(f.metadata)
    for key, value in changes.items():
        if value is None:
            meta.pop("deepseek2." + key)
        else:
            meta["deepseek2." + key] = value
    with pytest.raises(error, match=match):
        ARCH.spec_from_metadata(meta, f.tensors, f.path)


def _pre_split_copy(src: Path, dst: Path) -> Path:
    """``src`` as a converter before llama.cpp's MLA split wrote it: one ``attn_kv_b`` per layer, head
    sizes in ``key_length``/``value_length``, as many kv heads as heads, no ``*_mla`` keys."""
    import gguf
    import numpy as np

    reader, f = gguf.GGUFReader(src), GGUFFile.open(src)
    spec = load_model(f).spec
    changed = {"deepseek2.attention.key_length": spec.head_dim, "deepseek2.attention.value_length": spec.v_head_dim,
               "deepseek2.attention.head_count_kv": spec.n_heads}
    w = gguf.GGUFWriter(str(dst), "deepseek2")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.endswith("_mla"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, changed.get(name, field.contents()), field.types[0], sub)
    for name, ref in f.tensors.items():
        if name.endswith("attn_v_b.weight"):
            continue
        data = ref.data.view(np.float32).reshape(ref.shape)
        if name.endswith("attn_k_b.weight"):  # [nh, C, nope] + [nh, v, C] -> [nh * (nope + v), C]
            v_b = f.tensors[name.replace("attn_k_b", "attn_v_b")].data.view(np.float32).reshape(
                f.tensors[name.replace("attn_k_b", "attn_v_b")].shape)
            name, data = name.replace("attn_k_b", "attn_kv_b"), np.concatenate(
                (data.transpose(0, 2, 1), v_b), axis=1).reshape(-1, spec.kv_lora_rank)
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_files_from_before_the_mla_split_give_the_same_logits(tmp_path):
    """An older deepseek2 GGUF (one ``attn_kv_b``, what unsplit DeepSeek-V3/R1 files in circulation
    have; llama.cpp runs them through its non-MLA graph) loads with the same latent state and logits."""
    old = GGUFFile.open(_pre_split_copy(DATA / "model-f32.gguf", tmp_path / "pre-split.gguf"))
    assert "blk.1.attn_kv_b.weight" in old.tensors and "blk.1.attn_k_b.weight" not in old.tensors
    model = load_model(old)
    assert not model.spec.split_kv_b and model.spec.layer_state(0) == load_model(
        GGUFFile.open(DATA / "model-f32.gguf")).spec.layer_state(0)
    with torch.no_grad():
        ref = _hf()(_tokens(model.spec)[None]).logits[0]  # [T, V]
    assert (_logits(model, old) - ref).abs().max().item() <= 1e-4
