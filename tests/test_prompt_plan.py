"""The prompt planner (``strata_core.experts.prompt_plan``) under the ``peer_tier`` placement on
cpu,cpu: ``assign`` splits a prompt layer's experts by device and orders them by source, as the
grouped prefill reads them, and ``PromptPlanner`` keeps a layer's plan while residency and shares hold."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.experts.prompt_plan import assign

PROMPT = list(range(5, 41))
CHECKS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


def _tier(model, **options) -> Engine:
    settings_ = {"arena": "pinned"} | {k: options.pop(k) for k in list(options) if not k.startswith("peer_")}
    return Engine.load(model, strategy="peer_tier", devices=["cpu", "cpu"], max_context=128,
                       strategy_options=options, **settings_)


@CHECKS
@given(primary=st.integers(0, 16), peer=st.integers(1, 16), stream=st.sampled_from([0.0, 0.35, 0.65, 1.0]),
       seed=st.integers(0, 2 ** 16))
def test_a_prompt_layer_s_experts_are_split_by_device_and_ordered_by_source(model, primary, peer, stream, seed):
    """``assign`` (what the grouped prefill sorts a prompt layer's pairs by), for random tier contents:
    every expert on exactly one device, the peer's only experts of its cache or misses, and each
    device's list ordered by source (the experts of one cache consecutive, in chain order, the misses
    last), as ``grouped_rows`` reads them."""
    engine = _tier(model, expert_cache=primary, peer_slots=peer, peer_stream_frac=stream)
    rows = engine.experts.rows_for(0, "prompt")
    n_experts = rows.arena.n_experts
    everything = [(layer, e) for layer in rows.chains for e in range(n_experts)]
    random.Random(seed).shuffle(everything)
    for cache in engine.experts.caches.values():  # the primary's, then the peer's: disjoint by construction
        for entry in cache.table.resident():
            cache.table.evict(*entry)
    for cache in engine.experts.caches.values():
        cache.fill([entry for entry in everything if all(not c.table.holds(*entry)
                                                         for c in engine.experts.caches.values())])
    for layer, chain in rows.chains.items():
        holder = chain.holders(layer, list(range(n_experts)))
        owners = assign(chain, holder, peek=True)
        assert sorted(e for experts in owners for e in experts) == list(range(n_experts))
        (lane,) = chain.lanes
        assert all(holder[e] is None or holder[e][0] is lane.cache for e in owners[1])
        source = [*map(id, chain.caches()), None]
        for experts in owners:
            keys = [(source.index(None if holder[e] is None else id(holder[e][0])), e) for e in experts]
            assert keys == sorted(keys)


def test_a_planned_layer_s_plan_is_kept_while_the_residency_and_the_shares_hold(model):
    """``PromptPlanner``: a prediction and the layer after it share one plan, taking the predicted shares; a
    change of the residency makes a new plan from the tables."""
    engine = _tier(model, expert_cache=4, peer_slots=6, peer_stream_frac=0.5)
    rows = engine.experts.rows_for(0, "prompt")
    layer, chain = 1, rows.chains[1]
    (lane,) = chain.lanes
    first = rows.planner.plan(layer, chain, 4, take=False)
    assert rows.planner.plan(layer, chain, 4, take=False) is first
    missing = sum(1 for where in first.holder if where is None)
    share, credit = lane.split.peek(missing), lane.split.credit
    assert sum(1 for e in first.owners[1] if first.holder[e] is None) == share
    assert rows.planner.plan(layer, chain, 4) is first
    assert lane.split.credit == pytest.approx(credit + missing * 0.5 - share)
    entry = next(entry for entry in engine.experts.caches[0].table.resident() if entry[0] == layer)
    engine.experts.caches[0].table.evict(*entry)
    again = rows.planner.plan(layer, chain, 4, take=False)
    assert again is not first and again.holder == chain.holders(layer, list(range(rows.arena.n_experts)))
    assert again.holder[entry[1]] is None and first.holder[entry[1]] is not None
