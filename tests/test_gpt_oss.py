"""gpt-oss: the GGUF llama.cpp's converter makes of a tiny random HF GptOss (committed fixture, see
tools/make_llamacpp_fixture.py --arch gpt-oss) gives transformers' logits at every position: F32, Q8_0,
MXFP4 experts, and a hidden-256 variant quantized as llama-quantize Q4_K_M (--arch gpt-oss-q4_k_m); its
chat template renders the harmony format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from strata_core.text.chat import ChatTemplate
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.kvcache import KVCache
from strata_core.model.registry import load_model
from strata_core.model.transformer import MoEModel
from strata_core.model.gpt_oss.forward import GptOssModel
from strata_core.text.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "gpt-oss_llamacpp"
T = 16  # > 3 sliding windows of 4


def _tokens(spec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (T,), generator=torch.Generator().manual_seed(0))  # [T]


def _hf_state_from_gguf(path: Path) -> dict[str, torch.Tensor]:
    """The HF state dict holding gguf-py's dequantization of every tensor of ``path``, the converter's
    transformations undone: the experts' gate and up (and their biases) interleaved back into
    ``gate_up_proj [E, H, 2F]``, the expert matrices transposed back to ``[E, in, out]``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in GGUFReader(path).tensors}
    out = {"model.embed_tokens.weight": tensors.pop("token_embd.weight"),
           "lm_head.weight": tensors.pop("output.weight"), "model.norm.weight": tensors.pop("output_norm.weight")}
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias"}
    for proj, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
        names |= {f"attn_{proj}.{kind}": f"self_attn.{hf}_proj.{kind}" for kind in ("weight", "bias")}
    layers = {int(name.split(".")[1]) for name in tensors}
    for layer in sorted(layers):
        t = {n.removeprefix(f"blk.{layer}."): v for n, v in tensors.items() if n.startswith(f"blk.{layer}.")}
        p = f"model.layers.{layer}."
        out |= {p + hf: t[name] for name, hf in names.items()}
        gate, up = t["ffn_gate_exps.weight"].transpose(1, 2), t["ffn_up_exps.weight"].transpose(1, 2)  # [E, H, F]
        out[p + "mlp.experts.gate_up_proj"] = torch.stack((gate, up), dim=-1).flatten(-2)  # [E, H, 2F]
        out[p + "mlp.experts.gate_up_proj_bias"] = torch.stack(
            (t["ffn_gate_exps.bias"], t["ffn_up_exps.bias"]), dim=-1).flatten(-2)  # [E, 2F]
        out[p + "mlp.experts.down_proj"] = t["ffn_down_exps.weight"].transpose(1, 2)  # [E, F, H]
    return out


def _hf_reference(data: Path, name: str) -> torch.nn.Module:
    """transformers' GptOss with the weights of the GGUF ``data / name``: the committed HF checkpoint for
    the F32 file, gguf-py's dequantization of the file for the others."""
    from transformers import GptOssConfig, GptOssForCausalLM

    if name == "model-f32.gguf":
        return GptOssForCausalLM.from_pretrained(data, attn_implementation="eager", dtype=torch.float32).eval()
    hf = GptOssForCausalLM._from_config(GptOssConfig.from_pretrained(data), attn_implementation="eager",
                                        dtype=torch.float32)
    hf.load_state_dict(_hf_state_from_gguf(data / name), strict=True)
    return hf.eval()


def _logits(model: MoEModel, f: GGUFFile) -> torch.Tensor:
    with torch.no_grad():
        return model.forward(_tokens(model.spec), KVCache.for_spec(model.spec, 32),
                             DequantExpertRows(ExpertWeights(f, model.spec)))  # [T, V]


def _logit_diff(data: Path, name: str) -> float:
    """Max |Strata - transformers| over the logits at every position, both on the weights of ``data / name``."""
    f = GGUFFile.open(data / name)
    model = load_model(f)
    with torch.no_grad():
        ref = _hf_reference(data, name)(_tokens(model.spec)[None]).logits[0]  # [T, V]
    assert ref.abs().max() > 1.0
    return (_logits(model, f) - ref).abs().max().item()


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
@pytest.mark.parametrize("name, expert_type, dense_type", [("model-f32.gguf", "F32", "F32"),
                                                           ("model-mxfp4.gguf", "MXFP4", "F32"),
                                                           ("model-q8_0.gguf", "Q8_0", "Q8_0")])
def test_llamacpp_gguf_matches_transformers(name: str, expert_type: str, dense_type: str):
    """The converter's F32 and Q8_0 files and the MXFP4 one: transformers runs on the same weights (the
    HF checkpoint, or gguf-py's dequantization of the file)."""
    f = GGUFFile.open(DATA / name)
    model = load_model(f)
    spec = model.spec
    assert isinstance(model, GptOssModel)
    assert (spec.architecture, spec.n_layers, spec.n_experts, spec.sliding_window) == ("gpt-oss", 2, 4, 4)
    assert spec.swa_layers == (True, False)  # llama.cpp's default pattern 2: even layers slide
    assert (spec.rope_scaling, spec.rope_factor, spec.rope_orig_ctx) == ("yarn", 32.0, 4096)
    assert f.tensors["blk.0.ffn_up_exps.weight"].qtype == GGMLQuantizationType[expert_type]
    for dense in ("token_embd.weight", "output.weight", "blk.1.attn_q.weight", "blk.0.attn_output.weight"):
        assert f.tensors[dense].qtype == GGMLQuantizationType[dense_type]
    assert f.tensors["blk.0.ffn_gate_inp.weight"].qtype == GGMLQuantizationType.F32  # routers stay F32
    assert _logit_diff(DATA, name) <= 1e-4


@pytest.mark.usefixtures("float_cpu_kernels")  # against transformers' float product: the CPU kernels' float bodies
def test_llamacpp_q4_k_m_matches_transformers():
    """The K-quant fixture (hidden 256; tools/make_llamacpp_fixture.py --arch gpt-oss-q4_k_m: the
    converter's F32 file given llama-quantize Q4_K_M's tensor types, encoded by ggml's own quantizer):
    Q4_K expert gate/up, token embedding and attention q/k/v, Q6_K output and the last layer's attn_v, and
    the fallbacks of rows too short for 256 (Q5_0 attn_output and first ffn_down_exps, Q8_0 for the last
    layer's Q6_K ffn_down_exps); routers, biases, sinks and norms F32 (llama.cpp's llama-quantize Q4_K_M
    gives the same tensors, bytes included: the tool's --llama-quantize check). transformers runs on
    gguf-py's dequantization of the same file, so the bound is the float32 one of the F32 test."""
    from gguf import GGMLQuantizationType as Q

    data = DATA.parent / "gpt-oss-q4_k_m_llamacpp"
    f = GGUFFile.open(data / "model-q4_k_m.gguf")
    expected = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "blk.0.ffn_gate_inp.weight": Q.F32,
                "blk.0.attn_sinks.weight": Q.F32, "blk.0.ffn_gate_exps.bias": Q.F32, "blk.0.attn_q.bias": Q.F32}
    for layer, v_type, down_type in ((0, Q.Q4_K, Q.Q5_0), (1, Q.Q6_K, Q.Q8_0)):
        expected |= {f"blk.{layer}.{name}": qtype for name, qtype in (
            ("attn_q.weight", Q.Q4_K), ("attn_k.weight", Q.Q4_K), ("attn_v.weight", v_type),
            ("attn_output.weight", Q.Q5_0), ("ffn_gate_exps.weight", Q.Q4_K), ("ffn_up_exps.weight", Q.Q4_K),
            ("ffn_down_exps.weight", down_type))}
    assert {name: f.tensors[name].qtype for name in expected} == expected
    spec = load_model(f).spec
    assert (spec.hidden_size, spec.n_layers, spec.n_experts, spec.swa_layers) == (256, 2, 4, (True, False))
    assert _logit_diff(data, "model-q4_k_m.gguf") <= 1e-4


def test_hf_weights_from_gguf_undo_the_converter():
    """The helper above is the inverse of the converter: on the F32 file it gives back the HF checkpoint."""
    from safetensors.torch import load_file

    ours, ref = _hf_state_from_gguf(DATA / "model-f32.gguf"), load_file(DATA / "model.safetensors")
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.parametrize("change", ["no window", "unscaled rope", "no sinks", "silu experts"])
def test_each_gpt_oss_feature_changes_the_logits(change: str):
    """The comparison above would fail without each feature: dropping one moves the logits."""
    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    reference = _logits(model, f)
    spec = model.spec
    if change == "no window":
        model = GptOssModel(dataclasses.replace(spec, swa_layers=(False, False)), model.weights)
    elif change == "unscaled rope":
        model = GptOssModel(dataclasses.replace(spec, rope_scaling="none"), model.weights)
    elif change == "no sinks":
        for layer in range(spec.n_layers):
            model.weights.at(layer, "cpu")["attn_sinks.weight"].fill_(-float("inf"))
    else:
        plain = model.expert_ffn
        model.expert_ffn = lambda layer, device: dataclasses.replace(plain(layer, device), activation="silu")
    assert (_logits(model, f) - reference).abs().max().item() > 1e-2


def test_attention_in_query_blocks_gives_the_same_bits(monkeypatch):
    """A prompt whose scores exceed ``SCORES_BYTES`` is attended in blocks of queries: same logits."""
    from strata_core.model.gpt_oss import forward as gpt_oss

    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = load_model(f)
    whole = _logits(model, f)
    monkeypatch.setattr(gpt_oss, "SCORES_BYTES", 4 * model.spec.n_heads * 32 * 3)  # 3 queries a block
    assert torch.equal(_logits(model, f), whole)


def test_gate_values_reach_the_swiglu_clamp(monkeypatch):
    """Some gate and up values of the fixture's forward lie beyond swiglu_oai's limit, so the clamp is
    exercised by the comparison."""
    from strata_core.experts.ffn import ExpertFFN

    seen: list[torch.Tensor] = []
    glu = ExpertFFN.glu
    monkeypatch.setattr(ExpertFFN, "glu", lambda self, g, u: seen.append(torch.stack(
        [g.max(), u.abs().max()])) or glu(self, g, u))
    f = GGUFFile.open(DATA / "model-f32.gguf")
    _logits(load_model(f), f)
    assert (torch.stack(seen) > 7.0).any(0).all()


def test_chat_template_renders_harmony():
    """The GGUF's template (llama.cpp's copy of gpt-oss's) renders the harmony format, and each of its
    markers is one special token of the GGUF's tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    metadata = GGUFFile.open(DATA / "model-f32.gguf").metadata
    chat = ChatTemplate.from_gguf(metadata)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "the fox?"}]
    prompt = chat.render(messages)
    assert prompt.startswith("<|start|>system<|message|>")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in prompt
    assert "<|start|>user<|message|>hello<|end|><|start|>assistant<|channel|>final<|message|>hi<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>the fox?<|end|><|start|>assistant")
    expected = render_jinja_template([messages], chat_template=metadata["tokenizer.chat_template"],
                                     add_generation_prompt=True)[0][0]
    assert prompt == expected  # (both render today's date)
    tokenizer = Tokenizer.from_gguf(metadata)
    ids = tokenizer.encode("<|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in ids if tokens[i].startswith("<|")] == ["<|start|>", "<|channel|>", "<|message|>"]
    # as llama.cpp: <|return|> and <|call|> end generation, <|end|> (closing the analysis message) does not
    assert {tokens[i] for i in tokenizer.eos_token_ids} >= {"<|return|>", "<|call|>"}
    assert "<|end|>" not in {tokens[i] for i in tokenizer.eos_token_ids}


def test_synthetic_presets_have_gpt_oss_shapes_and_info_shows_the_window(tmp_path):
    """``make-synthetic --preset gpt-oss-120b`` has the real shapes (MXFP4 experts by default);
    ``gpt-oss-tiny`` loads, generates, and ``strata info`` reports the sliding window."""
    from strata_core.cli.info import describe
    from strata_core.engine import Engine
    from strata_core.tools.synthetic import PRESETS, _tensors, write_synthetic

    preset = PRESETS["gpt-oss-120b"]
    shapes = {name: (shape, qtype) for name, shape, qtype, _ in _tensors(preset, preset.expert_type,
                                                                        GGMLQuantizationType.Q8_0)}
    assert sum(name.endswith("ffn_gate_exps.weight") for name in shapes) == 36
    assert shapes["blk.35.ffn_gate_exps.weight"] == ((128, 2880, 2880), GGMLQuantizationType.MXFP4)
    assert shapes["blk.0.ffn_down_exps.bias"] == ((128, 2880), GGMLQuantizationType.F32)
    assert shapes["blk.0.attn_q.weight"][0] == (64 * 64, 2880) and shapes["blk.0.attn_sinks.weight"][0] == (64,)
    path = tmp_path / "gpt-oss-tiny.gguf"
    write_synthetic(path, "gpt-oss-tiny", progress=False)
    spec = load_model(GGUFFile.open(path)).spec
    assert (spec.sliding_window, spec.swa_layers, spec.rope_scaling) == (8, (True, False), "yarn")
    assert GGUFFile.open(path).tensors["blk.1.ffn_up_exps.weight"].qtype == GGMLQuantizationType.MXFP4
    assert len(Engine.load(path, max_context=64).generate("hello", max_tokens=4, temperature=0)) > 0
    report = describe(path, [8.0], max_context=64)
    assert "sliding window: 8 tokens on 1 of 2 layers (0), the others full attention; attention sinks" in report


def test_sliding_window_pattern_as_llama_cpp_reads_it():
    """``attention.sliding_window_pattern``: absent = 2 (layers 0, 2, ... slide), an integer n (layer il
    slides when il % n < n - 1; 0: every layer), or one bool per layer; anything else is an error."""
    from strata_core.errors import ModelFileError
    from strata_core.model.gpt_oss.architecture import _swa_layers

    key = "gpt-oss.attention.sliding_window_pattern"
    assert _swa_layers({}, "gpt-oss", 4, "f") == (True, False, True, False)
    assert _swa_layers({key: 3}, "gpt-oss", 6, "f") == (True, True, False, True, True, False)
    assert _swa_layers({key: 0}, "gpt-oss", 3, "f") == (True, True, True)
    assert _swa_layers({key: [False, True, True]}, "gpt-oss", 3, "f") == (False, True, True)
    for bad in ([True, False], "2", -1):
        with pytest.raises(ModelFileError, match="sliding_window_pattern"):
            _swa_layers({key: bad}, "gpt-oss", 3, "f")
