"""gpt-oss: the GGUF llama.cpp's converter makes of a tiny random HF GptOss (committed fixture, see
tools/make_llamacpp_fixture.py --arch gpt-oss) gives transformers' logits at every position, with
F32 and MXFP4 experts; its chat template renders the harmony format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from strata_core.chat import ChatTemplate
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model import KVCache, MoEModel
from strata_core.model.gpt_oss import GptOssModel
from strata_core.quant import dequantize
from strata_core.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "gpt-oss_llamacpp"
T = 16  # > 3 sliding windows of 4


def _tokens(spec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (T,), generator=torch.Generator().manual_seed(0))  # [T]


def _hf_reference(f: GGUFFile) -> torch.nn.Module:
    """The HF model of the fixture, its experts replaced by the GGUF's dequantized ones (gate and up
    interleaved back into ``gate_up_proj [E, H, 2F]``, ``down_proj [E, F, H]``)."""
    from transformers import GptOssForCausalLM

    hf = GptOssForCausalLM.from_pretrained(DATA, attn_implementation="eager", dtype=torch.float32).eval()
    for i, layer in enumerate(hf.model.layers):
        def load(name: str) -> torch.Tensor:
            ref = f.tensors[f"blk.{i}.{name}"]
            return dequantize(ref.raw(), ref.qtype, ref.shape).float()

        experts = layer.mlp.experts
        with torch.no_grad():
            experts.gate_up_proj[..., ::2] = load("ffn_gate_exps.weight").transpose(1, 2)
            experts.gate_up_proj[..., 1::2] = load("ffn_up_exps.weight").transpose(1, 2)
            experts.down_proj.copy_(load("ffn_down_exps.weight").transpose(1, 2))
    return hf


def _logits(model: MoEModel, f: GGUFFile) -> torch.Tensor:
    with torch.no_grad():
        return model.forward(_tokens(model.spec), KVCache.for_spec(model.spec, 32),
                             DequantExpertRows(ExpertWeights(f, model.spec)))  # [T, V]


@pytest.mark.parametrize("name, expert_type", [("model-f32.gguf", "F32"), ("model-mxfp4.gguf", "MXFP4")])
def test_llamacpp_gguf_matches_transformers(name: str, expert_type: str):
    f = GGUFFile.open(DATA / name)
    model = MoEModel.load(f)
    spec = model.spec
    assert isinstance(model, GptOssModel)
    assert (spec.architecture, spec.n_layers, spec.n_experts, spec.sliding_window) == ("gpt-oss", 2, 4, 4)
    assert spec.swa_layers == (True, False)  # llama.cpp's default pattern 2: even layers slide
    assert (spec.rope_scaling, spec.rope_factor, spec.rope_orig_ctx) == ("yarn", 32.0, 4096)
    assert f.tensors["blk.0.ffn_up_exps.weight"].qtype == GGMLQuantizationType[expert_type]
    hf = _hf_reference(f)
    with torch.no_grad():
        ref = hf(_tokens(spec)[None]).logits[0]  # [T, V]
    ours = _logits(model, f)
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("change", ["no window", "unscaled rope", "no sinks", "silu experts"])
def test_each_gpt_oss_feature_changes_the_logits(change: str):
    """The comparison above would fail without each feature: dropping one moves the logits."""
    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = MoEModel.load(f)
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
    from strata_core.model import gpt_oss

    f = GGUFFile.open(DATA / "model-f32.gguf")
    model = MoEModel.load(f)
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
    _logits(MoEModel.load(f), f)
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
    from strata_core.synthetic import PRESETS, _tensors, write_synthetic

    preset = PRESETS["gpt-oss-120b"]
    shapes = {name: (shape, qtype) for name, shape, qtype, _ in _tensors(preset, preset.expert_type,
                                                                        GGMLQuantizationType.Q8_0)}
    assert sum(name.endswith("ffn_gate_exps.weight") for name in shapes) == 36
    assert shapes["blk.35.ffn_gate_exps.weight"] == ((128, 2880, 2880), GGMLQuantizationType.MXFP4)
    assert shapes["blk.0.ffn_down_exps.bias"] == ((128, 2880), GGMLQuantizationType.F32)
    assert shapes["blk.0.attn_q.weight"][0] == (64 * 64, 2880) and shapes["blk.0.attn_sinks.weight"][0] == (64,)
    path = tmp_path / "gpt-oss-tiny.gguf"
    write_synthetic(path, "gpt-oss-tiny", progress=False)
    spec = MoEModel.load(GGUFFile.open(path)).spec
    assert (spec.sliding_window, spec.swa_layers, spec.rope_scaling) == (8, (True, False), "yarn")
    assert GGUFFile.open(path).tensors["blk.1.ffn_up_exps.weight"].qtype == GGMLQuantizationType.MXFP4
    assert len(Engine.load(path, max_context=64).generate("hello", max_tokens=4, temperature=0)) > 0
    report = describe(path, [8.0], max_context=64)
    assert "sliding window: 8 tokens on 1 of 2 layers (0), the others full attention; attention sinks" in report


def test_sliding_window_pattern_as_llama_cpp_reads_it():
    """``attention.sliding_window_pattern``: absent = 2 (layers 0, 2, ... slide), an integer n (layer il
    slides when il % n < n - 1; 0: every layer), or one bool per layer; anything else is an error."""
    from strata_core.errors import ModelFileError
    from strata_core.gguf.arch.gpt_oss import _swa_layers

    key = "gpt-oss.attention.sliding_window_pattern"
    assert _swa_layers({}, "gpt-oss", 4, "f") == (True, False, True, False)
    assert _swa_layers({key: 3}, "gpt-oss", 6, "f") == (True, True, False, True, True, False)
    assert _swa_layers({key: 0}, "gpt-oss", 3, "f") == (True, True, True)
    assert _swa_layers({key: [False, True, True]}, "gpt-oss", 3, "f") == (False, True, True)
    for bad in ([True, False], "2", -1):
        with pytest.raises(ModelFileError, match="sliding_window_pattern"):
            _swa_layers({key: bad}, "gpt-oss", 3, "f")
