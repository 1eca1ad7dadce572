"""``--cuda-graphs``: eager fallback where graphs do not apply, the capture cache, and (on CUDA)
replayed windows equal to eager ones."""

from __future__ import annotations

import logging

import pytest
import torch

from strata_core.engine import Engine
from strata_core.testing.sync import no_host_sync
from strata_core.runtime.graphs import BUCKETS, DecodeGraphs, _Graph, bucket
from strata_core.plugin.placement import Segment
from strata_core.model.spec import StateTensor
from strata_core.model import kvtransfer
from strata_core.model.kvcache import KVCache
from strata_core.runtime.session import DecodeBatch, Session

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _decode(engine: Engine, prompts: list[list[int]], windows: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Greedy decode of every prompt in one batch: logits of each window ``[B, V]`` and the tokens."""
    sessions = [engine.new_session() for _ in prompts]
    tokens = [int(engine.prefill(s, p).argmax()) for s, p in zip(sessions, prompts)]
    out, logits = [[t] for t in tokens], []
    for _ in range(windows):
        rows = engine.decode_window(list(zip(sessions, tokens)))
        logits.append(rows.cpu())
        tokens = [int(r.argmax()) for r in rows]
        for seq, t in zip(out, tokens):
            seq.append(t)
    return logits, out


# --- CPU ------------------------------------------------------------------------------------------

def test_cpu_falls_back_to_eager_with_identical_logits(tiny_model_factory, caplog):
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = [list(range(5, 30)), list(range(40, 52))]
    want, want_tokens = _decode(Engine.load(path, devices=["cpu"], max_context=64, cuda_graphs=False), prompts, 4)
    engine = Engine.load(path, devices=["cpu"], max_context=64)  # graphs on by default
    with caplog.at_level(logging.INFO, logger="strata_core.runtime.graph_replays"):
        got, got_tokens = _decode(engine, prompts, 4)
    assert got_tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    said = [r.getMessage() for r in caplog.records if "decode runs eagerly" in r.getMessage()]
    assert len(said) == 1 and "not a CUDA device" in said[0]  # once, with the reason
    assert len(engine.runner.graphs) == 0


def test_static_body_matches_the_eager_layers_on_cpu(tiny_model_factory):
    """The body a graph captures (whole-capacity attention, device positions) on the CPU."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = Engine.load(path, devices=["cpu"], max_context=64)
    sessions = [engine.new_session(), engine.new_session()]
    engine.prefill(sessions[0], list(range(5, 20)))
    engine.prefill(sessions[1], list(range(7, 11)))
    batch = DecodeBatch(sessions=tuple(sessions), tokens=torch.tensor([3, 9]))
    (segment,) = engine.runner.segments("decode")
    hidden = engine.runner.embed(batch.tokens, torch.device("cpu"))
    eager = engine.runner.decode_segment(segment, hidden, batch)
    static = engine.runner.decode_layers(segment, hidden, batch, positions=batch.positions, static=True)
    assert torch.equal(eager, static)


class _CountingGraphs(DecodeGraphs):
    """The cache logic with the capture replaced by a fake."""

    def __init__(self, max_graphs: int = 4):
        super().__init__(experts=None, max_graphs=max_graphs)

    def _capture(self, segment, batch, inputs, body, step):
        return _Graph(graph=None, inputs=inputs, out=inputs["hidden"])


def _session(max_tokens: int = 8) -> Session:
    row = StateTensor((1, 4))
    return Session(kv=KVCache(range(2), max_tokens, {i: {"k": row, "v": row} for i in range(2)}))


def _batch(*sessions: Session) -> DecodeBatch:
    return DecodeBatch(sessions=sessions, tokens=torch.zeros(len(sessions), dtype=torch.int64))


def test_capture_cache_is_keyed_by_batch_size_layers_and_step_alone():
    """No graph depends on its sessions: another session, a longer context, a moved or released one
    replay the same graph; only B, the layers and the whole step capture again."""
    graphs, layers, hidden = _CountingGraphs(), Segment(0, range(2)), torch.zeros(1, 4)
    a, b = _session(), _session()
    first = graphs.entry(layers, _batch(a), {"hidden": hidden}, None)
    assert graphs.entry(layers, _batch(b), {"hidden": hidden}, None) is first and graphs.captures == 1
    a.tokens.extend([1, 2, 3])
    a.kv.advance(3)
    kvtransfer.move(a.kv, range(1, 2), slot=1, device="cpu")
    assert graphs.entry(layers, _batch(a), {"hidden": hidden}, None) is first
    a.kv.release()
    del a
    assert graphs.entry(layers, _batch(b), {"hidden": hidden}, None) is first and len(graphs) == 1
    graphs.entry(layers, _batch(b, _session()), {"hidden": hidden}, None)  # B = 2
    graphs.entry(layers, _batch(b), {"hidden": hidden}, None, step=True)  # the whole step: its own graph
    graphs.entry(Segment(0, range(1)), _batch(b), {"hidden": hidden}, None)  # other layers
    assert graphs.captures == 4 and len(graphs) == 4
    assert DecodeGraphs.key(layers, _batch(b, b)) == (2, 0, 0, 2, False)
    graphs.invalidate()
    assert len(graphs) == 0


def test_capture_cache_keeps_the_most_recent_graphs():
    graphs, hidden = _CountingGraphs(max_graphs=2), torch.zeros(1, 4)
    a, b, c = (Segment(0, range(i, i + 1)) for i in range(3))
    window = _batch(_session())
    graphs.entry(a, window, {"hidden": hidden}, None)
    graphs.entry(b, window, {"hidden": hidden}, None)
    graphs.entry(a, window, {"hidden": hidden}, None)  # a is now the most recent
    graphs.entry(c, window, {"hidden": hidden}, None)  # evicts b
    assert graphs.captures == 3 and len(graphs) == 2
    graphs.entry(a, window, {"hidden": hidden}, None)
    assert graphs.captures == 3
    graphs.entry(b, window, {"hidden": hidden}, None)
    assert graphs.captures == 4


def test_windows_pad_to_the_next_bucket():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 130)] == [1, 2, 4, 4, 8, 8, 16, 64, 64, 128, 192]
    assert all(bucket(b) == b for b in BUCKETS)
    with pytest.raises(ValueError, match="at least one session"):
        bucket(0)


def test_padding_fills_a_window_to_its_bucket_and_counts_the_real_rows():
    from strata_core.runtime.buckets import BatchPadding

    made: list[Session] = []
    padding = BatchPadding(lambda: made.append(_session()) or made[-1], experts_used=8)
    a, b, c = _session(), _session(), _session()
    padded, live = padding.pad(_batch(a, b, c))
    assert len(made) == 1 and padded.sessions == (a, b, c, made[0]) and live == 3
    assert padded.tokens.tolist() == [0, 0, 0, 0] and padded.positions.tolist() == [0, 0, 0, 0]
    two, live = padding.pad(_batch(a, b))  # a full bucket: as it is
    assert two.sessions == (a, b) and live == 2
    assert padding.pad(padded)[1] == 3 and padding.live_pairs(3).tolist() == [24]
    assert [len(w) for w in padding.windows(5)] == [1, 2, 4, 8] and len(made) == 1
    assert all(s is made[0] for w in padding.windows(3) for s in w.sessions)


def test_capturing_the_buckets_does_nothing_without_graphs(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0", n_layers=2), devices=["cpu"], max_context=32)
    engine.capture_decode_graphs(8)
    assert len(engine.runner.graphs) == 0 and engine.telemetry.routed == 0


# --- CUDA -----------------------------------------------------------------------------------------

def _cuda_engine(path, graphs: bool) -> Engine:
    return Engine.load(path, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                       expert_cache=7, cuda_graphs=graphs)


PROMPTS = [list(range(5, 60)), list(range(70, 90)), list(range(3, 14))]


@needs_cuda
@pytest.mark.parametrize("n_sessions", [1, 2, 3])
def test_graph_windows_equal_eager_windows(tiny_model_factory, n_sessions):
    """Three sessions replay the graph of bucket 4: the padded row changes none of theirs."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = PROMPTS[:n_sessions]
    want, want_tokens = _decode(_cuda_engine(path, False), prompts, 12)
    engine = _cuda_engine(path, True)
    got, got_tokens = _decode(engine, prompts, 12)
    graphs = engine.runner.graphs
    assert graphs.failed is None and graphs.captures == 1 and len(graphs) == 1
    assert got_tokens == want_tokens
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert diff <= 1e-5, diff


@needs_cuda
@pytest.mark.parametrize("n_sessions", [2, 3])
def test_graph_windows_keep_the_telemetry(tiny_model_factory, n_sessions):
    """The same counts and usage profile as eager windows, also when a padded row rides along (3 in 4)."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = PROMPTS[:n_sessions]
    snaps, profiles = [], []
    for graphs in (False, True):
        engine = _cuda_engine(path, graphs)
        _decode(engine, prompts, 6)
        snaps.append(engine.telemetry.snapshot())
        profiles.append(engine.experts.usage_profile())
    names = ("expert_hits", "expert_misses", "experts_resident", "experts_pcie", "bytes_streamed")
    assert {n: snaps[1][n] for n in names} == {n: snaps[0][n] for n in names}
    assert torch.equal(profiles[1].counts, profiles[0].counts) and profiles[1].tokens == profiles[0].tokens


@needs_cuda
def test_replayed_windows_make_no_host_sync_and_a_new_session_set_captures_again(tiny_model_factory):
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = _cuda_engine(path, True)
    session = engine.new_session()
    token = int(engine.prefill(session, list(range(5, 40))).argmax())
    token = int(engine.decode_window([(session, token)])[0].argmax())  # captures
    for _ in range(4):
        with no_host_sync():
            row = engine.decode_window([(session, token)])
        token = int(row[0].argmax())
    graphs = engine.runner.graphs
    assert graphs.captures == 1
    other = engine.new_session()
    engine.prefill(other, list(range(9, 20)))
    engine.decode_window([(session, token), (other, 3)])
    assert graphs.captures == 2  # B = 2
    engine.release_session(other)
    third = engine.new_session()
    engine.prefill(third, list(range(30, 41)))
    with no_host_sync():  # a new session replays the graph of B = 1 (address tables), no capture
        engine.decode_window([(third, 5)])
    assert graphs.captures == 2 and len(graphs) == 2
    assert all(key[4] for key in graphs._graphs)  # whole-step graphs


@needs_cuda
def test_buckets_captured_at_start_serve_every_window_size(tiny_model_factory, caplog):
    """``capture_decode_graphs(5)`` captures buckets 1, 2, 4 and 8 (logged) and counts nothing; windows of
    1 to 5 sessions joining and leaving then replay them without a capture or a host sync."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = _cuda_engine(path, True)
    with caplog.at_level(logging.INFO, logger="strata_core.runtime.graph_replays"):
        engine.capture_decode_graphs(5)
    graphs = engine.runner.graphs
    assert graphs.captures == 4 and "decode windows of 1, 2, 4, 8 session(s) captured" in caplog.text
    assert engine.telemetry.routed == 0 and engine.experts.usage_profile().tokens == 0
    sessions = [engine.new_session() for _ in range(5)]
    for i, session in enumerate(sessions):
        engine.prefill(session, list(range(3 + i, 20 + 2 * i)))
    for n in (1, 3, 5, 2, 4, 5, 1):
        with no_host_sync():
            engine.decode_window([(s, 7) for s in sessions[:n]])
    assert graphs.captures == 4
