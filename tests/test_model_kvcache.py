"""KVCache: write/read, truncate (rows and recurrent state); kvtransfer: hand-off between device slots and ranks,
host snapshot/restore; DenseWeights.place."""

from __future__ import annotations

import pytest
import torch

from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.model.spec import StateTensor
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import write_gguf
from strata_core.model import kvtransfer
from strata_core.model.kvcache import KVCache
from strata_core.model.weights import DenseWeights


ROW = StateTensor((2, 4))
#: a hybrid layout: layer 1 keeps a recurrent state (float32 whatever the cache dtype) beside no rows
HYBRID = {0: {"k": ROW, "v": ROW}, 1: {"conv": StateTensor((3, 4), per_token=False, dtype=torch.float32)},
          2: {"k": ROW, "v": ROW}}


def filled(layers=range(3), n=5, layout=None, block_size=2) -> KVCache:
    kv = KVCache(layers, 8, layout or {i: {"k": ROW, "v": ROW} for i in layers}, block_size=block_size)
    kv.reserve(n)
    for i in layers:
        if "k" in kv.pool_rows(i):
            kv.write(i, torch.arange(n), k=torch.randn(n, 2, 4), v=torch.randn(n, 2, 4))
        else:
            kv.state(i, "conv").normal_()
    kv.advance(n)
    return kv


def test_truncate_and_overflow():
    kv = filled()
    assert kv.blocks(0) == [1, 2, 3]  # 5 positions in blocks of 2
    kv.truncate(3)
    assert kv.n_tokens == 3 and kv.read(0, kv.n_tokens)[0].shape == (3, 2, 4)
    assert kv.blocks(0) == [1, 2] and kv.pools.pools[0].n_free == 3  # the third block is back in the pool, beside the padding block
    with pytest.raises(ValueError, match="overflow"):
        kv.advance(6)
    with pytest.raises(ValueError, match="overflow"):
        kv.reserve(9)


def test_reads_gather_the_blocks_and_zeros_past_them():
    kv = filled(n=3)
    k, _ = kv.read(0, 8)  # the whole capacity: blocks not held read as the null block's zeros
    assert k.shape == (8, 2, 4) and not k[4:].any()
    assert torch.equal(kv.committed(0)["k"], k[:3])


def test_recurrent_state_is_never_rewound_but_reset_at_zero():
    kv = filled(layout=HYBRID)
    assert not kv.can_truncate and filled().can_truncate
    with pytest.raises(ValueError, match="cannot rewind recurrent state from 5 to 3"):
        kv.truncate(3)
    assert kv.n_tokens == 5 and kv.state(1, "conv").abs().sum() > 0
    kv.truncate(0)
    assert kv.n_tokens == 0 and not kv.state(1, "conv").any() and kv.blocks(0) == []



def test_a_window_that_kept_its_steps_rewinds_recurrent_state_to_any_of_its_positions():
    """``keep_steps`` before a window of several rows, ``keep_step`` after each: ``truncate`` inside the
    window puts back the state after the last row kept, rows and blocks as for attention K/V; before the
    window, or once the next phase has reserved, it is refused as ever."""
    kv = filled(layout=HYBRID)
    kv.reserve(8)
    kv.keep_steps()
    states = [kv.state(1, "conv").clone()]  # before the window: not kept (its first row always stays)
    for position in range(5, 8):  # three rows: each writes K/V and advances the recurrent state
        for i in (0, 2):
            kv.write(i, torch.tensor([position]), k=torch.randn(1, 2, 4), v=torch.randn(1, 2, 4))
        kv.state(1, "conv").add_(1.0)
        for i in range(3):
            kv.keep_step(i)
        states.append(kv.state(1, "conv").clone())
    kv.advance(3)
    assert kv.keeps_steps
    kv.truncate(7)
    assert kv.n_tokens == 7 and torch.equal(kv.state(1, "conv"), states[2])
    kv.truncate(6)  # cut back again inside the same window
    assert torch.equal(kv.state(1, "conv"), states[1]) and kv.blocks(0) == [1, 2, 3]
    with pytest.raises(ValueError, match="cannot rewind recurrent state from 6 to 5"):
        kv.truncate(5)  # the window's first row cut too
    with pytest.raises(ValueError, match="cannot rewind recurrent state from 6 to 4"):
        kv.truncate(4)  # before the window
    kv.advance(1)  # position 6 again, then the next phase: the window's states no longer follow
    kv.reserve(8)
    assert not kv.keeps_steps
    with pytest.raises(ValueError, match="cannot rewind recurrent state from 7 to 6"):
        kv.truncate(6)  # what the window's states would have allowed

def test_hand_off_moves_only_the_given_layers_and_keeps_the_way_back():
    kv = filled(layout=HYBRID)
    before = {i: {name: t.clone() for name, t in kv.committed(i).items()} for i in range(3)}
    conv = kv.state(1, "conv")
    kvtransfer.move(kv, range(1, 3), slot=1, device="cpu")
    assert kv.home == {0: 0, 1: 1, 2: 1}
    assert kv.pool_rows(2)["k"] is kv.pools.pools[1].rows[2]["k"] and kv.pool_rows(0) is kv.pools.pools[0].rows[0]
    assert len(kv.blocks(1)) == 3 and kvtransfer.parked(kv, 0, 1) is None
    assert kvtransfer.parked(kv, 1, 0)["conv"] is conv
    assert torch.equal(kv.state(1, "conv"), before[1]["conv"])  # the whole recurrent state
    assert torch.equal(kv.read(2, 5)[0], before[2]["k"]) and not kv.read(2, 8)[0][6:].any()
    assert torch.equal(kvtransfer.parked(kv, 2, 0)["k"], before[2]["k"])
    kv.reserve(6)
    kv.write(2, torch.tensor([5]), k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4))
    kv.state(1, "conv").add_(1)
    kv.advance(1)
    blocks = kv.blocks(0)
    kvtransfer.move(kv, range(1, 3), slot=0, device="cpu")  # back: the same blocks and parked state, with the new rows
    assert kv.blocks(0) == blocks and kv.state(1, "conv") is conv and kv.home[2] == 0
    assert torch.equal(kv.read(2, 6)[0][5], torch.ones(2, 4)) and torch.equal(kv.read(2, 5)[0], before[2]["k"])
    assert torch.equal(kv.state(1, "conv"), before[1]["conv"] + 1)


def test_layers_leave_for_another_process_and_arrive_back_with_its_rows():
    """``leave``: the layers' rows and state as host copies, the layers away (no read, no snapshot);
    a mirror of those layers alone takes them whole; ``arrive`` brings them back onto their blocks."""
    kv = filled(layout=HYBRID)
    before = {i: {name: t.clone() for name, t in kv.committed(i).items()} for i in range(3)}
    blocks = kv.blocks(0)
    snap = kvtransfer.leave(kv, range(1, 3), slot=1)
    assert kv.home == {0: 0} and kv.away == {1: 1, 2: 1} and kv.n_tokens == 5
    assert torch.equal(snap.tensors[2]["k"], before[2]["k"]) and torch.equal(snap.tensors[1]["conv"], before[1]["conv"])
    with pytest.raises(ValueError, match="layer 1's state is on another rank's device slot 1"):
        kvtransfer.snapshot(kv)
    mirror = KVCache(range(1, 3), 8, {1: HYBRID[1], 2: HYBRID[2]}, block_size=2)  # the other process's
    kvtransfer.arrive(mirror, snap, slot=0, device="cpu")
    assert mirror.n_tokens == 5 and torch.equal(mirror.read(2, 5)[0], before[2]["k"])
    mirror.reserve(6)  # one more position computed there
    mirror.write(2, torch.tensor([5]), k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4))
    mirror.state(1, "conv").add_(1)
    mirror.advance(1)
    back = kvtransfer.leave(mirror, range(1, 3), slot=0)
    with pytest.raises(ValueError, match="the rows received hold 6 positions, this cache 5"):
        kvtransfer.arrive(kv, back, slot=0, device="cpu")
    kv.reserve(6)
    kv.write(0, torch.tensor([5]), k=torch.ones(1, 2, 4), v=torch.ones(1, 2, 4))
    kv.advance(1)
    kvtransfer.arrive(kv, back, slot=0, device="cpu")
    assert kv.home == {0: 0, 1: 0, 2: 0} and kv.away == {} and kv.blocks(0) == blocks
    assert torch.equal(kv.read(2, 6)[0][:5], before[2]["k"]) and torch.equal(kv.read(2, 6)[0][5], torch.ones(2, 4))
    assert torch.equal(kv.state(1, "conv"), before[1]["conv"] + 1)
    with pytest.raises(ValueError, match="cannot receive layer 1 on slot 1: .* at home on slot 0"):
        kvtransfer.arrive(kv, back, slot=1, device="cpu")


def test_snapshot_restore_roundtrip():
    kv = filled(layout=HYBRID)
    snap = kvtransfer.snapshot(kv)
    k0, conv = kv.read(0, 5)[0].clone(), kv.state(1, "conv").clone()
    table = kv.block_table(0)
    kv.truncate(0)
    kv.reserve(5)
    kv.write(0, torch.arange(5), k=torch.zeros(5, 2, 4), v=torch.zeros(5, 2, 4))
    kvtransfer.restore(kv, snap)
    assert kv.n_tokens == 5 and torch.equal(kv.read(0, 5)[0], k0) and torch.equal(kv.state(1, "conv"), conv)
    assert kv.block_table(0) is table  # refilled in place: a graph reading it stays valid
    assert snap.tensors[0]["k"].device.type == "cpu"
    assert snap.nbytes == 2 * (2 * 5 * 2 * 4 * 4) + 3 * 4 * 4


def test_release_returns_every_block():
    kv = filled()
    pool = kv.pools.pools[0]
    assert pool.n_free == pool.n_blocks - 1 - 3
    kv.release()
    assert pool.n_free == pool.n_blocks - 1 and kv.released and kv.blocks(0) == []


def test_state_layout_follows_the_spec(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_hf_model("qwen3moe"), path)
    spec = load_model_spec(GGUFFile.open(path))
    kv = KVCache.for_spec(spec, 16, dtype=torch.bfloat16, block_size=4)
    assert set(kv.pool_rows(0)) == {"k", "v"}
    assert kv.pool_rows(0)["k"].shape == (6, 4, spec.n_kv_heads, spec.head_dim)  # 4 blocks + the null and padding blocks
    assert spec.rewindable and spec.state_bytes(24, torch.bfloat16) == kv.pools.pools[0].nbytes


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
