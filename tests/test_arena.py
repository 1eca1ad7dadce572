"""The arena: pinned copies equal the mmap bytes; the pin limit keeps later layers as mmap views."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.experts.arena import Arena
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.tools.synthetic import Preset, write_synthetic

PRESET = Preset(n_layers=3, n_experts=4, n_experts_used=2, hidden=64, expert_ffn=32, n_heads=4,
                n_kv_heads=2, head_dim=16, vocab=320, context=512)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("arena") / "m.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, dense_type=Q.Q8_0, progress=False)
    gguf_file = GGUFFile.open(path)
    return ExpertWeights(gguf_file, load_model_spec(gguf_file))


def test_mmap_arena_is_zero_copy(weights):
    arena = Arena(weights, 3, 4, "mmap")
    assert arena.pinned_bytes == 0 and arena.packed(0, 0) is None
    gate, _, _ = arena.parts(1, 2)
    assert gate.data_ptr() == weights.blocks(1, 2).gate.data_ptr()


def test_pinned_arena_copies_bytes_and_respects_the_limit(weights):
    per_layer = weights.expert_nbytes(0) * 4
    arena = Arena(weights, 3, 4, "pinned", pin_limit_bytes=2 * per_layer + 1)
    assert arena.pinned_bytes == 2 * per_layer  # whole layers only: layer 2 stays mmap
    assert arena.packed(1, 3) is not None and arena.packed(2, 0) is None
    for layer in range(3):
        for expert in range(4):
            b = weights.blocks(layer, expert)
            for got, want in zip(arena.parts(layer, expert), (b.gate, b.up, b.down)):
                assert torch.equal(got, want)
    packed = torch.empty(arena.slot_bytes, dtype=torch.uint8)
    arena.pack_into(2, 1, packed)
    assert torch.equal(packed[: arena.formats[2].total], torch.cat(arena.parts(2, 1)))


def test_the_pinned_fill_reports_its_progress_and_rate(weights, caplog):
    seen: list[float] = []
    with caplog.at_level("INFO", logger="strata_core.experts.arena"):
        arena = Arena(weights, 3, 4, "pinned", progress=seen.append)
    assert arena.all_pinned and seen == sorted(seen) and seen[-1] == 1.0
    lines = [r.getMessage() for r in caplog.records if " filled in " in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(r"arena: [\d.]+ GiB filled in [\d.]+ s \([\d.]+ GB/s, \d+ threads; "
                                            r"allocating [\d.]+ s, copying [\d.]+ s\)", lines[0])
