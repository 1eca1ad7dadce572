"""KVCache: write/read, truncate (rows and recurrent state), hand-off between device slots, host snapshot/restore; DenseWeights.place."""

from __future__ import annotations

import pytest
import torch

from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.model.spec import StateTensor
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import write_gguf
from strata_core.model.kvcache import KVCache
from strata_core.model.weights import DenseWeights


ROW = StateTensor((2, 4))
#: a hybrid layout: layer 1 keeps a recurrent state (float32 whatever the cache dtype) beside no rows
HYBRID = {0: {"k": ROW, "v": ROW}, 1: {"conv": StateTensor((3, 4), per_token=False, dtype=torch.float32)},
          2: {"k": ROW, "v": ROW}}


def filled(layers=range(3), n=5, layout=None) -> KVCache:
    kv = KVCache(layers, 8, layout or {i: {"k": ROW, "v": ROW} for i in layers})
    for i in layers:
        if "k" in kv.tensors[i]:
            kv.write(i, torch.arange(n), k=torch.randn(n, 2, 4), v=torch.randn(n, 2, 4))
        else:
            kv.state(i, "conv").normal_()
    kv.advance(n)
    return kv


def test_truncate_and_overflow():
    kv = filled()
    kv.truncate(3)
    assert kv.n_tokens == 3 and kv.read(0, kv.n_tokens)[0].shape == (3, 2, 4)
    with pytest.raises(ValueError, match="overflow"):
        kv.advance(6)


def test_recurrent_state_is_never_rewound_but_reset_at_zero():
    kv = filled(layout=HYBRID)
    assert not kv.can_truncate and filled().can_truncate
    with pytest.raises(ValueError, match="cannot rewind recurrent state from 5 to 3"):
        kv.truncate(3)
    assert kv.n_tokens == 5 and kv.state(1, "conv").abs().sum() > 0
    kv.truncate(0)
    assert kv.n_tokens == 0 and not kv.state(1, "conv").any()


def test_hand_off_moves_only_the_given_layers_and_keeps_the_way_back():
    kv = filled(layout=HYBRID)
    before = {i: {name: t.clone() for name, t in kv.tensors[i].items()} for i in range(3)}
    originals = {i: kv.tensors[i] for i in range(3)}
    kv.move(range(1, 3), slot=1, device="cpu")
    assert kv.home == {0: 0, 1: 1, 2: 1}
    assert kv.tensors[0] is originals[0]
    for i in (1, 2):
        assert kv.tensors[i] is not originals[i] and kv.parked(i, 0) is originals[i]
    assert torch.equal(kv.state(1, "conv"), before[1]["conv"])  # the whole recurrent state
    assert torch.equal(kv.tensors[2]["k"][:5], before[2]["k"][:5]) and not kv.tensors[2]["k"][5:].any()
    kv.write(2, torch.tensor([5]), k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4))
    kv.state(1, "conv").add_(1)
    kv.advance(1)
    kv.move(range(1, 3), slot=0, device="cpu")  # back: the parked tensors again, with the new state
    assert kv.tensors[2] is originals[2] and kv.home[2] == 0 and torch.equal(kv.tensors[2]["k"][5], torch.ones(2, 4))
    assert torch.equal(kv.state(1, "conv"), before[1]["conv"] + 1)


def test_snapshot_restore_roundtrip():
    kv = filled(layout=HYBRID)
    snap = kv.snapshot()
    k0, conv = kv.tensors[0]["k"][:5].clone(), kv.state(1, "conv").clone()
    kv.truncate(0)
    kv.write(0, torch.arange(5), k=torch.zeros(5, 2, 4), v=torch.zeros(5, 2, 4))
    kv.restore(snap)
    assert kv.n_tokens == 5 and torch.equal(kv.tensors[0]["k"][:5], k0) and torch.equal(kv.state(1, "conv"), conv)
    assert snap.tensors[0]["k"].device.type == "cpu" and snap.tensors[0]["k"].data_ptr() != kv.tensors[0]["k"].data_ptr()
    assert snap.nbytes == 2 * (2 * 5 * 2 * 4 * 4) + 3 * 4 * 4


def test_state_layout_follows_the_spec(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_hf_model("qwen3moe"), path)
    spec = load_model_spec(GGUFFile.open(path))
    kv = KVCache.for_spec(spec, 16, dtype=torch.bfloat16)
    assert set(kv.tensors[0]) == {"k", "v"} and kv.tensors[0]["k"].shape == (16, spec.n_kv_heads, spec.head_dim)
    assert spec.rewindable and spec.state_bytes(16, torch.bfloat16) == sum(
        t.numel() * t.element_size() for named in kv.tensors.values() for t in named.values())


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
