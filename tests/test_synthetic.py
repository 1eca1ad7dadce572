"""Synthetic models: real shapes from a preset, valid finite blocks, readable by the engine's loader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.quant import dequantize
from strata_core.tools.synthetic import PRESETS, _tensors, write_synthetic
from strata_core.text.tokenizer import Tokenizer


@pytest.mark.parametrize("expert_type", [Q.Q4_K, Q.IQ4_XS, Q.Q8_0])
def test_tiny_preset_loads_with_finite_blocks(tmp_path, expert_type):
    path = tmp_path / "tiny.gguf"
    size = write_synthetic(path, "tiny", expert_type=expert_type, progress=False)
    gguf_file = GGUFFile.open(path)
    assert size == path.stat().st_size
    spec = load_model_spec(gguf_file)
    p = PRESETS["tiny"]
    assert (spec.n_layers, spec.n_experts, spec.n_experts_used, spec.hidden_size, spec.expert_ffn_size,
            spec.vocab_size) == (p.n_layers, p.n_experts, p.n_experts_used, p.hidden, p.expert_ffn, p.vocab)
    ref = gguf_file.tensors["blk.1.ffn_down_exps.weight"]
    assert ref.qtype == expert_type
    values = dequantize(ref.raw(), ref.qtype, ref.shape)
    assert torch.isfinite(values).all() and 0 < values.abs().max() < 1
    assert Tokenizer.from_gguf(gguf_file.metadata).encode("hello")


def test_qwen3_30b_preset_has_the_real_shapes():
    shapes = {name: (shape, qtype) for name, shape, qtype, _ in _tensors(PRESETS["qwen3-30b-a3b"], Q.Q4_K, Q.Q8_0)}
    assert sum(name.endswith("ffn_gate_exps.weight") for name in shapes) == 48
    assert shapes["blk.47.ffn_gate_exps.weight"] == ((128, 768, 2048), Q.Q4_K)
    assert shapes["blk.0.ffn_down_exps.weight"] == ((128, 2048, 768), Q.Q4_K)
    assert shapes["blk.0.attn_q.weight"][0] == (32 * 128, 2048)
    assert shapes["blk.0.attn_k.weight"][0] == (4 * 128, 2048)
    assert shapes["token_embd.weight"][0] == (151936, 2048)


def test_unknown_preset_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="qwen3-30b-a3b"):
        write_synthetic(tmp_path / "x.gguf", "nope")


def test_same_seed_same_file(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synthetic(a, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    write_synthetic(b, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    assert np.array_equal(np.fromfile(a, np.uint8), np.fromfile(b, np.uint8))


def test_a_context_longer_than_the_preset_s(tmp_path):
    """``context``: the file declares it (the engine's --max-context is capped by it), nothing else changes."""
    plain, long = tmp_path / "plain.gguf", tmp_path / "long.gguf"
    write_synthetic(plain, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1)
    write_synthetic(long, "tiny", expert_type=Q.Q8_0, progress=False, n_layers=1, context=262144)
    specs = [load_model_spec(GGUFFile.open(path)) for path in (plain, long)]
    assert specs[0].context_length == PRESETS["tiny"].context and specs[1].context_length == 262144
    assert specs[1] == dataclasses.replace(specs[0], context_length=262144)
