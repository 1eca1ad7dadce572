"""Qwen3-Next (GGUF ``qwen3next``): the GGUFs llama.cpp's converter made of a tiny random HF model
(committed fixture, tools/make_llamacpp_fixture.py --arch qwen3next) give transformers' logits at
every position; the Gated DeltaNet's two forms agree; the layer pattern and shapes come from the GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.weights import ExpertWeights
from strata_core.model.qwen3next.architecture import ARCH
from strata_core.model.qwen3next.spec import Qwen3NextSpec
from strata_core.gguf.reader import GGUFFile
from strata_core.model.kvcache import KVCache
from strata_core.model.registry import load_model
from strata_core.model.transformer import MoEModel
from strata_core.model.qwen3next.deltanet import causal_conv, delta_rule_chunked, delta_rule_recurrent, l2_norm
from strata_core.model.qwen3next.forward import Qwen3NextModel

DATA = Path(__file__).parent / "data" / "qwen3next_llamacpp"


def _hf_state_from_gguf(path: Path, config) -> dict[str, torch.Tensor]:
    """The HF checkpoint (saved names) holding gguf-py's dequantization of every tensor of ``path``:
    the converter's transformations undone (norms - 1, ``A_log``, the q/k/v/z interleave per key head)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_group = config.linear_num_value_heads // nk * config.linear_value_head_dim
    tensors = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in GGUFReader(path).tensors}
    out = {"model.embed_tokens.weight": tensors.pop("token_embd.weight"),
           "model.norm.weight": tensors.pop("output_norm.weight") - 1}
    names = {"attn_norm.weight": ("input_layernorm.weight", -1),
             "post_attention_norm.weight": ("post_attention_layernorm.weight", -1),
             "attn_q.weight": ("self_attn.q_proj.weight", 0), "attn_k.weight": ("self_attn.k_proj.weight", 0),
             "attn_v.weight": ("self_attn.v_proj.weight", 0), "attn_output.weight": ("self_attn.o_proj.weight", 0),
             "attn_q_norm.weight": ("self_attn.q_norm.weight", -1),
             "attn_k_norm.weight": ("self_attn.k_norm.weight", -1),
             "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", 0), "ssm_dt.bias": ("linear_attn.dt_bias", 0),
             "ssm_norm.weight": ("linear_attn.norm.weight", 0), "ssm_out.weight": ("linear_attn.out_proj.weight", 0),
             "ffn_gate_inp.weight": ("mlp.gate.weight", 0),
             "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", 0),
             "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", 0),
             "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", 0)}
    for layer in range(config.num_hidden_layers):
        t = {n.removeprefix(f"blk.{layer}."): v for n, v in tensors.items() if n.startswith(f"blk.{layer}.")}
        p = f"model.layers.{layer}."
        out |= {p + hf: t[gguf] + shift for gguf, (hf, shift) in names.items() if gguf in t}
        out[p + "mlp.shared_expert_gate.weight"] = t["ffn_gate_inp_shexp.weight"].reshape(1, -1)
        for e in range(config.num_experts):
            for proj in ("gate", "up", "down"):
                out[p + f"mlp.experts.{e}.{proj}_proj.weight"] = t[f"ffn_{proj}_exps.weight"][e]
        if "attn_qkv.weight" in t:
            qkv, H = t["attn_qkv.weight"], config.hidden_size
            q, k, v = qkv[:nk * dk], qkv[nk * dk:2 * nk * dk], qkv[2 * nk * dk:]
            groups = (q.view(nk, dk, H), k.view(nk, dk, H), v.view(nk, per_group, H),
                      t["attn_gate.weight"].view(nk, per_group, H))
            out[p + "linear_attn.in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, H)
            out[p + "linear_attn.conv1d.weight"] = t["ssm_conv1d.weight"][:, None, :]
            out[p + "linear_attn.A_log"] = torch.log(-t["ssm_a"])
    return out


def _hf_model(tmp_path: Path, gguf_name: str, data: Path = DATA):
    """transformers' Qwen3-Next with the weights of the GGUF ``data / gguf_name`` (dequantized by gguf-py)."""
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    if gguf_name == "model-f32.gguf":
        return Qwen3NextForCausalLM.from_pretrained(data, attn_implementation="eager", dtype=torch.float32).eval()
    config = Qwen3NextConfig.from_pretrained(data)
    config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in _hf_state_from_gguf(data / gguf_name, config).items()},
              tmp_path / "model.safetensors")
    return Qwen3NextForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()


def _logit_diff(f: GGUFFile, model: MoEModel, hf, seed: int) -> float:
    """Max |Strata - transformers| over the logits of 70 random tokens (more than one prompt chunk)."""
    spec = model.spec
    tokens = torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(seed))  # [T]
    with torch.no_grad():
        ours = model.forward(tokens, KVCache.for_spec(spec, 80), DequantExpertRows(ExpertWeights(f, spec)))
        ref = hf(tokens[None]).logits[0]  # [T, V]
    assert ref.abs().max() > 1.0
    return (ours - ref).abs().max().item()


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
@pytest.mark.parametrize("gguf_name", ["model-f32.gguf", "model-q8_0.gguf"])
def test_llamacpp_gguf_matches_transformers(gguf_name, tmp_path):
    f = GGUFFile.open(DATA / gguf_name)
    model = load_model(f)
    spec = model.spec
    assert isinstance(model, Qwen3NextModel) and isinstance(spec, Qwen3NextSpec)
    assert (spec.n_layers, spec.recurrent, spec.rope_dim, spec.head_dim) == (3, (True, False, True), 4, 16)
    assert (spec.gdn_k_heads, spec.gdn_v_heads, spec.gdn_head_dim, spec.conv_kernel) == (2, 4, 8, 4)
    assert spec.tied_embeddings and spec.norm_topk_prob and spec.has_shared_expert
    assert _logit_diff(f, model, _hf_model(tmp_path, gguf_name), seed=0) <= 1e-4


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
def test_llamacpp_q4_k_m_matches_transformers(tmp_path):
    """The K-quant fixture (hidden 256; tools/make_llamacpp_fixture.py --arch qwen3next-q4_k_m: the
    converter's F32 file given llama-quantize Q4_K_M's tensor types, encoded by ggml's own quantizer):
    Q4_K experts, projections and GDN qkv/gate, Q6_K tied embedding and attn_v, the fallbacks of rows
    too short for 256 (Q5_0 / Q8_0 ffn_down_exps, Q5_0 attn_output / ssm_out, F16 ffn_down_shexp).
    transformers runs on gguf-py's dequantization of the same file, so both sides see the same
    weights (Strata's dequantization is gguf-py's bit for bit, tests/test_quant.py) and the bound is the
    float32 one of the F32 test (measured 4.5e-6). Against the unquantized weights no bound would be
    tight: Q4_K's ~7% weight error moves this random model's logits by up to 3.9 (of 4.2)."""
    from gguf import GGMLQuantizationType as Q

    data = DATA.parent / "qwen3next-q4_k_m_llamacpp"
    f = GGUFFile.open(data / "model-q4_k_m.gguf")
    qtypes = {name: t.qtype for name, t in f.tensors.items()}
    assert (qtypes["blk.0.ffn_gate_exps.weight"], qtypes["blk.1.attn_q.weight"], qtypes["blk.0.attn_qkv.weight"],
            qtypes["token_embd.weight"], qtypes["blk.1.attn_v.weight"]) == (Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K)
    assert (qtypes["blk.0.ffn_down_exps.weight"], qtypes["blk.1.ffn_down_exps.weight"],
            qtypes["blk.0.ffn_down_shexp.weight"]) == (Q.Q5_0, Q.Q8_0, Q.F16)
    model = load_model(f)
    spec = model.spec
    assert (spec.hidden_size, spec.n_layers, spec.recurrent) == (256, 2, (True, False))
    assert _logit_diff(f, model, _hf_model(tmp_path, "model-q4_k_m.gguf", data), seed=1) <= 1e-4


def test_hf_weights_from_gguf_undo_the_converter():
    """The helper above is the inverse of the converter: on the F32 file it gives back the HF checkpoint."""
    from safetensors.torch import load_file
    from transformers import Qwen3NextConfig

    ours = _hf_state_from_gguf(DATA / "model-f32.gguf", Qwen3NextConfig.from_pretrained(DATA))
    ref = load_file(DATA / "model.safetensors")
    assert ours.keys() == ref.keys()
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6


def _metadata(**changes):
    f = GGUFFile.open(DATA / "model-f32.gguf")
    meta = dict(f.metadata)
    for key, value in changes.items():
        key = "qwen3next." + key
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta, f


def test_layer_pattern_from_the_interval_when_no_array():
    meta, f = _metadata(**{"attention.recurrent_layers": None, "full_attention_interval": 3})
    assert ARCH.spec_from_metadata(meta, f.tensors, f.path).recurrent == (True, True, False)
    meta, f = _metadata(**{"attention.recurrent_layers": None, "full_attention_interval": None})
    assert ARCH.spec_from_metadata(meta, f.tensors, f.path).recurrent == (True, True, True)  # default 4


def test_mtp_blocks_are_not_layers():
    meta, f = _metadata(nextn_predict_layers=1, **{"attention.recurrent_layers": [True, False, False]})
    spec = ARCH.spec_from_metadata(meta, f.tensors, f.path)
    assert (spec.n_layers, spec.mtp_layers, spec.recurrent) == (2, 1, (True, False))
    ARCH.validate(f, spec)  # blk.2 (the "MTP block") is present but not checked as a layer


@pytest.mark.parametrize("changes, error, match", [
    ({"attention.recurrent_layers": [True, False]}, ModelFileError, "3 booleans"),
    ({"ssm.time_step_rank": 3}, ModelFileError, "multiple"),
    ({"ssm.inner_size": 48}, UnsupportedError, "inner_size"),
    ({"rope.dimension_count": 17}, ModelFileError, "dimension_count"),
    ({"ssm.conv_kernel": None}, ModelFileError, "conv_kernel"),
])
def test_bad_metadata_is_named(changes, error, match):
    meta, f = _metadata(**changes)
    with pytest.raises(error, match=match):
        ARCH.spec_from_metadata(meta, f.tensors, f.path)


def test_state_declared_per_layer():
    spec = load_model(GGUFFile.open(DATA / "model-f32.gguf")).spec
    gdn, attn = spec.layer_state(0), spec.layer_state(1)
    assert set(gdn) == {"conv", "ssm"} and not any(t.per_token for t in gdn.values())
    assert gdn["conv"].shape == (3, spec.conv_dim) and gdn["ssm"].shape == (4, 8, 8)
    assert set(attn) == {"k", "v"} and attn["k"].per_token
    assert not spec.rewindable


def _gdn_inputs(T: int, heads: int = 4, dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2_norm(torch.randn(T, heads, dim, generator=gen), 1e-6) for _ in range(2))
    v = torch.randn(T, heads, dim, generator=gen)
    g = -torch.rand(T, heads, generator=gen)  # log decay <= 0
    beta = torch.rand(T, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dim, dim, generator=gen)


@given(T=st.integers(1, 150), split=st.integers(0, 150))
@settings(max_examples=15, deadline=None)
def test_recurrent_delta_rule_is_bit_identical_across_splits(T, split):
    q, k, v, g, beta, s0 = _gdn_inputs(T)
    split = min(split, T)
    whole_state, parts_state = s0.clone(), s0.clone()
    whole = delta_rule_recurrent(q, k, v, g, beta, whole_state)
    parts = torch.cat([delta_rule_recurrent(q[:split], k[:split], v[:split], g[:split], beta[:split], parts_state),
                       delta_rule_recurrent(q[split:], k[split:], v[split:], g[split:], beta[split:], parts_state)])
    assert torch.equal(whole, parts) and torch.equal(whole_state, parts_state)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_delta_rule_matches_recurrent_and_transformers(T):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, s0 = _gdn_inputs(T)
    rec_state, chunk_state = s0.clone(), s0.clone()
    rec = delta_rule_recurrent(q, k, v, g, beta, rec_state)
    chunked = delta_rule_chunked(q, k, v, g, beta, chunk_state)
    ref, ref_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=s0[None], output_final_state=True)
    assert rec.abs().max() > 0.1
    for out, state in ((chunked, chunk_state), (ref[0], ref_state[0])):
        assert (out - rec).abs().max() <= 1e-4 and (state - rec_state).abs().max() <= 1e-4


def test_causal_conv_continues_its_state():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(10, 6, generator=gen), torch.randn(6, 4, generator=gen)
    ref = F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=3, groups=6)[0, :, :10].T)  # [T, C]
    state = torch.zeros(3, 6)
    out = torch.cat([causal_conv(x[:2], state, weight), causal_conv(x[2:], state, weight)])
    assert (out - ref).abs().max() <= 1e-6
    assert torch.equal(state, x[-3:])


def test_synthetic_80b_preset_has_the_real_shapes():
    from gguf import GGMLQuantizationType as Q

    from strata_core.tools.synthetic import PRESETS, _tensors

    shapes = {name: shape for name, shape, _, _ in _tensors(PRESETS["qwen3-next-80b-a3b"], Q.Q4_K, Q.Q8_0)}
    assert sum(name.endswith("attn_qkv.weight") for name in shapes) == 36  # 3 of every 4 of 48 layers
    assert "blk.3.attn_qkv.weight" not in shapes and shapes["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048)
    assert shapes["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert shapes["blk.0.ssm_ba.weight"] == (64, 2048) and shapes["blk.0.ssm_conv1d.weight"] == (8192, 4)
    assert shapes["blk.47.ffn_gate_exps.weight"] == (512, 512, 2048)
    assert shapes["blk.47.ffn_down_shexp.weight"] == (2048, 512)


def test_synthetic_tiny_preset_runs(tmp_path):
    from strata_core.engine import Engine
    from strata_core.tools.synthetic import write_synthetic

    path = tmp_path / "q3n.gguf"
    write_synthetic(path, "qwen3-next-tiny", progress=False)
    engine = Engine.load(path, max_context=64)
    spec = engine.spec
    assert isinstance(spec, Qwen3NextSpec) and spec.recurrent == (True, True, True, False)
    assert (engine.model.weights.at(0, "cpu")["ssm_a"] < 0).all()  # decays, not growths
    logits = engine.logits(list(range(3, 40)))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_info_shows_the_layer_pattern_and_the_recurrent_state():
    from strata_core.cli.info import describe

    text = describe(DATA / "model-q8_0.gguf", [24.0])
    assert ("KV per token: 128 bytes in bf16 (k [2, 16] + v [2, 16] x 1 layers), plus 3.5 KiB of recurrent "
            "state per session (conv [3, 64] float32 + ssm [4, 8, 8] float32 x 2 layers)") in text
    assert "Gated DeltaNet on 2 of 3 layers" in text and "gated full attention on layers 1" in text
    assert "RoPE on 4 of 16 head dims" in text
