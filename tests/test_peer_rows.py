"""The peer lane (``strata_core.experts.peer``) under the ``peer_tier`` placement on cpu,cpu: a
computing peer gets its pairs through its own lane, once per MoE layer, and an exception in the
peer's rows ends only that request (tables as before, the next request exact against single)."""

from __future__ import annotations

import pytest
import torch

from strata_core.engine import Engine
from strata_core.experts.peer import PeerLane
from strata_core.testing.residency import check_tiers

PROMPT = list(range(5, 41))


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


@pytest.fixture(scope="module")
def reference(model):
    """single's logits of PROMPT and its greedy continuation."""
    single = Engine.load(model, max_context=128, expert_cache=0)
    return single.logits(PROMPT), single.generate(PROMPT, max_tokens=6, temperature=0)


def _tier(model, **options) -> Engine:
    settings_ = {"arena": "pinned"} | {k: options.pop(k) for k in list(options) if not k.startswith("peer_")}
    return Engine.load(model, strategy="peer_tier", devices=["cpu", "cpu"], max_context=128,
                       strategy_options=options, **settings_)


def test_the_peer_computes_its_rows_on_its_own_lane(model, monkeypatch):
    """The decode gather sends the peer its pairs through the lane (once per MoE layer), and the
    prompt's grouped path too with peer_prefill_rows != 0 (with 0 the prompt reads the peer's cache
    across)."""
    entered = []  # a lane's first block of a layer (a prompt layer enters again for the rows coming back)
    real = PeerLane.enqueue

    def enqueue(lane, after=None, again=False):
        if not again:
            entered.append(lane.name)
        return real(lane, after, again)

    monkeypatch.setattr(PeerLane, "enqueue", enqueue)
    engine = _tier(model, expert_cache=4, peer_slots=6)  # the default: prompts compute on the peer
    engine.experts.use_gather(True)
    engine.experts.use_grouped_prefill(True)
    session = engine.new_session()
    engine.prefill(session, PROMPT)
    prompt = len(entered)
    engine.decode_window([(session, 3)])
    assert 0 < prompt <= 4 and len(entered) - prompt == 4 and set(entered) == {"cpu#1"}
    entered.clear()
    across = _tier(model, expert_cache=4, peer_slots=6, peer_prefill_rows=0)
    across.experts.use_grouped_prefill(True)
    across.prefill(across.new_session(), PROMPT)
    assert entered == [] and across.telemetry.by_device()["cpu#0"]["peer"] > 0


@pytest.mark.parametrize("where", ["prompt", "window"])
def test_a_failing_peer_fails_the_request_and_the_next_one_runs(model, reference, monkeypatch, where):
    """An exception in the peer's rows ends the request with it; the tables are as before, the
    tiers disjoint, and the next request gives single's output."""
    engine = _tier(model, expert_cache=4, peer_slots=6, adapt_swaps=1, peer_prefill_rows=-1)  # the prompt computes there
    engine.experts.use_gather(True)
    engine.experts.use_grouped_prefill(True)
    session = engine.new_session()
    if where == "window":
        engine.prefill(session, PROMPT)
    before = {slot: table.host.clone() for slot, table in engine.experts.tables.items()}
    real = PeerLane.enqueue

    def failing(lane, after=None):
        raise RuntimeError("the peer's rows failed")

    monkeypatch.setattr(PeerLane, "enqueue", failing)
    with pytest.raises(RuntimeError, match="the peer's rows failed"):
        if where == "window":
            engine.decode_window([(session, 3)])
        else:
            engine.prefill(session, PROMPT)
    monkeypatch.setattr(PeerLane, "enqueue", real)
    assert all(torch.equal(table.host, before[slot]) for slot, table in engine.experts.tables.items())
    check_tiers(engine)
    engine.release_session(session)
    engine.experts.use_grouped_prefill(False)
    assert torch.equal(engine.logits(PROMPT), reference[0])
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[1]
