"""DESIGN invariant 3 in the decode loop across stages (the ``layer_split`` placement on cpu,cpu):
the host reads of a window, counted on the CPU by ``HostReads`` (the per-expert loop's
``device_rows.group_by_expert`` included), do not grow with the layer count under the decode gather."""

from __future__ import annotations

import pytest

from strata_core.engine import Engine
from strata_core.experts import device_rows
from strata_core.testing.sync import HostReads

PROMPT = list(range(5, 41))


def _split(model, cut: int, **settings) -> Engine:
    return Engine.load(model, strategy="layer_split", devices=["cpu", "cpu"], max_context=128,
                       strategy_options={"split": str(cut)}, **settings)


def _host_reads(engine: Engine, monkeypatch) -> list[str]:
    """Tensor reads to the host made while a decode window of two sessions runs."""
    reads = HostReads(monkeypatch)
    reads.watch(device_rows, "group_by_expert")
    sessions = [engine.new_session(), engine.new_session()]
    for session in sessions:
        engine.prefill(session, PROMPT[:12])
    with reads.counting() as seen:
        engine.decode_window([(sessions[0], 3), (sessions[1], 4)])
    return seen


@pytest.mark.parametrize("gather", [True, False])
def test_host_syncs_per_window_do_not_grow_with_the_layer_count(tiny_model_factory, monkeypatch, gather):
    """With the decode gather a window reads nothing back per layer, whatever the split; the
    per-expert loop reads the routing once per layer (so the count can fail)."""
    counts = []
    for n_layers in (2, 4):
        path = tiny_model_factory(n_layers=n_layers, expert_type="Q8_0")
        engine = _split(path, n_layers // 2, expert_cache=3, arena="pinned")
        engine.experts.use_gather(gather)
        with monkeypatch.context() as patch:
            counts.append(len(_host_reads(engine, patch)))
    if gather:
        assert counts[0] == counts[1]
    else:
        assert counts[1] > counts[0]
