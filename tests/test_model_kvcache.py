"""KVCache: write/read, truncate, hand-off between device slots, host snapshot/restore; DenseWeights.place."""

from __future__ import annotations

import pytest
import torch

from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.spec import load_model_spec
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import write_gguf
from strata_core.model import DenseWeights, KVCache


def filled(layers=range(3), n=5) -> KVCache:
    kv = KVCache(layers, max_tokens=8, n_kv_heads=2, head_dim=4)
    for i in layers:
        kv.write(i, torch.arange(n), torch.randn(n, 2, 4), torch.randn(n, 2, 4))
    kv.advance(n)
    return kv


def test_truncate_and_overflow():
    kv = filled()
    kv.truncate(3)
    assert kv.n_tokens == 3 and kv.read(0, kv.n_tokens)[0].shape == (3, 2, 4)
    try:
        kv.advance(6)
    except ValueError as e:
        assert "overflow" in str(e)
    else:
        raise AssertionError("advance past max_tokens must fail")


def test_hand_off_moves_only_the_given_layers_and_keeps_the_way_back():
    kv = filled()
    before = {i: (kv.k[i].clone(), kv.v[i].clone()) for i in range(3)}
    originals = {i: kv.k[i] for i in range(3)}
    kv.move(range(1, 3), slot=1, device="cpu")
    assert kv.home == {0: 0, 1: 1, 2: 1}
    assert kv.k[0] is originals[0]
    for i in (1, 2):
        assert kv.k[i] is not originals[i] and kv.parked(i, 0)[0] is originals[i]
        assert torch.equal(kv.k[i][:5], before[i][0][:5]) and torch.equal(kv.v[i][:5], before[i][1][:5])
    kv.write(2, torch.tensor([5]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    kv.advance(1)
    kv.move(range(2, 3), slot=0, device="cpu")  # back: the parked tensor again, with the new row
    assert kv.k[2] is originals[2] and kv.home[2] == 0 and torch.equal(kv.k[2][5], torch.ones(2, 4))


def test_snapshot_restore_roundtrip():
    kv = filled()
    snap = kv.snapshot()
    k0 = kv.k[0][:5].clone()
    kv.truncate(0)
    kv.write(0, torch.arange(5), torch.zeros(5, 2, 4), torch.zeros(5, 2, 4))
    kv.restore(snap)
    assert kv.n_tokens == 5 and torch.equal(kv.k[0][:5], k0)
    assert snap.k[0].device.type == "cpu" and snap.k[0].data_ptr() != kv.k[0].data_ptr()


def test_dense_weights_placed_per_layer_on_one_or_several_devices(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_hf_model("qwen3moe", tie_word_embeddings=True), path)
    f = GGUFFile.open(path)
    w = DenseWeights.load(f, load_model_spec(f))
    assert w.globals["output.weight"] is w.globals["token_embd.weight"]  # tied
    assert w.at(1, "cpu")["attn_q.weight"].shape == (128, 64)
    meta, cpu = torch.device("meta"), torch.device("cpu")
    w.place({0: {meta}, 1: {meta, cpu}}, globals_device=meta)
    assert w.at(1, "meta")["attn_q.weight"].device == meta and w.at(1, "cpu")["attn_q.weight"].device == cpu
    assert w.at(0, "meta")["attn_q.weight"].device == meta
    with pytest.raises(ConfigError, match="layer 0"):
        w.at(0, "cpu")  # freed: no longer needed on the CPU
    assert w.globals["output.weight"] is w.globals["token_embd.weight"] and w.globals["output.weight"].device == meta
