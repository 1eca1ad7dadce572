"""KVCache: write/read, truncate, hand-off between caches, host snapshot/restore; DenseWeights.to."""

from __future__ import annotations

import torch

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


def test_hand_off_copies_only_the_given_layers():
    src = filled()
    dst = KVCache(range(1, 3), max_tokens=8, n_kv_heads=2, head_dim=4)
    dst.copy_layers_from(src, range(1, 3))
    assert dst.n_tokens == 5
    for i in (1, 2):
        assert torch.equal(dst.k[i][:5], src.k[i][:5]) and torch.equal(dst.v[i][:5], src.v[i][:5])


def test_snapshot_restore_roundtrip():
    kv = filled()
    snap = kv.snapshot()
    k0 = kv.k[0][:5].clone()
    kv.truncate(0)
    kv.write(0, torch.arange(5), torch.zeros(5, 2, 4), torch.zeros(5, 2, 4))
    kv.restore(snap)
    assert kv.n_tokens == 5 and torch.equal(kv.k[0][:5], k0)
    assert snap.k[0].device.type == "cpu" and snap.k[0].data_ptr() != kv.k[0].data_ptr()


def test_dense_weights_move_per_layer_range(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_hf_model("qwen3moe", tie_word_embeddings=True), path)
    f = GGUFFile.open(path)
    w = DenseWeights.load(f, load_model_spec(f))
    assert w.globals["output.weight"] is w.globals["token_embd.weight"]  # tied
    assert w.layers[1]["attn_q.weight"].shape == (128, 64)
    w.to("meta", layers=range(1, 2), head=True)
    assert w.device_of(0).type == "cpu" and w.device_of(1).type == "meta"
    assert w.globals["output.weight"].device.type == "meta"
    assert w.globals["token_embd.weight"].device.type == "cpu"
