"""The arena: pinned copies equal the mmap bytes; the pin limit keeps later layers as mmap views."""

from __future__ import annotations

import ctypes
import gc
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


def _expect_bytes(arena, weights):
    for layer in range(3):
        for expert in range(4):
            b = weights.blocks(layer, expert)
            for got, want in zip(arena.parts(layer, expert), (b.gate, b.up, b.down)):
                assert torch.equal(got, want)


@pytest.fixture
def accelerator(monkeypatch):
    """An accelerator that page-locks: registrations recorded (address, bytes, whether the bytes were filled
    then) and unregistrations; ``refuse`` (a count) makes the registration after that many fail."""
    from strata_core.experts import arena as arena_module
    from strata_core.experts import host_region

    state = {"registered": [], "unregistered": [], "refuse": None}

    def register(address, nbytes):
        if state["refuse"] is not None and len(state["registered"]) >= state["refuse"]:
            raise RuntimeError("cudaHostRegister of 1 bytes failed: cudaErrorHostMemoryAlreadyRegistered")
        window = (ctypes.c_uint8 * nbytes).from_address(address)
        state["registered"].append((address, nbytes, any(window)))

    monkeypatch.setattr(arena_module, "can_pin", lambda: True)
    monkeypatch.setattr(host_region, "_register", register)
    monkeypatch.setattr(host_region, "_unregister", state["unregistered"].append)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # torch's pinned copy, on the CPU
    return state


def test_with_an_accelerator_each_layer_is_filled_then_page_locked_once(weights, accelerator, caplog):
    with caplog.at_level("INFO", logger="strata_core.experts.arena"):
        arena = Arena(weights, 3, 4, "pinned")
    assert arena.all_pinned
    _expect_bytes(arena, weights)
    registered = accelerator["registered"]
    assert len(registered) == 3 and all(filled for _, _, filled in registered)  # the fill came first
    for layer in range(3):  # each layer's buffer is one whole registered region
        buf = arena.layer_buffer(layer)
        assert (buf.data_ptr(), buf.numel()) in {(address, nbytes) for address, nbytes, _ in registered}
    text = caplog.text
    assert re.search(r"allocating [\d.]+ s, copying [\d.]+ s, registering [\d.]+ s\)", text)
    assert "arena: 3 buffers page-locked once filled (transparent huge pages: " in text
    addresses = sorted(address for address, _, _ in registered)
    del arena, buf
    gc.collect()
    assert sorted(accelerator["unregistered"]) == addresses  # unregistered when the arena goes


def test_a_refused_registration_copies_the_layers_into_torchs_pinned_buffers(weights, accelerator, caplog):
    accelerator["refuse"] = 1  # the first region registers, the second is refused
    with caplog.at_level("WARNING", logger="strata_core.experts.arena"):
        arena = Arena(weights, 3, 4, "pinned")
    assert "cudaErrorHostMemoryAlreadyRegistered; the layers are copied into torch's pinned buffers" in caplog.text
    assert arena.all_pinned and not arena._regions
    _expect_bytes(arena, weights)
    assert [a for a, _, _ in accelerator["registered"]] == accelerator["unregistered"]  # the one registered, undone


def test_the_transparent_huge_page_mode_is_read_from_the_kernel(tmp_path):
    from strata_core.experts.host_region import transparent_huge_pages

    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(tmp_path / "enabled")) == "madvise"
    assert transparent_huge_pages(str(tmp_path / "absent")) == "unknown"
