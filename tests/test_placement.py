"""Placements the core executes: validation, logical devices, peer sources, hand-off, no wasted logits."""

from __future__ import annotations

import types

import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.model import kvtransfer
from strata_core.runtime.phase_state import HandOffError
from strata_core.plugin import CacheBudget, ExpertSource, LayerPlacement, Placement, hookimpl

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


def _plugin(placement: Placement, **hooks) -> types.ModuleType:
    """A strategy plugin answering ``strata_topology`` with ``placement`` (and ``hooks``)."""
    from strata_core.plugin import StrategySpec

    module = types.ModuleType("fixed_placement")

    @hookimpl
    def strata_register_strategies(register):
        register(StrategySpec(name="fixed", description="a fixed placement", plugin=module))

    @hookimpl
    def strata_topology(devices, spec, settings, options):
        return placement

    module.strata_register_strategies, module.strata_topology = strata_register_strategies, strata_topology
    for name, impl in hooks.items():
        setattr(module, name, hookimpl(impl))
    return module


def _load(model, monkeypatch, placement: Placement, devices=("cpu", "cpu"), **settings) -> Engine:
    """Load ``model`` under a strategy whose placement is ``placement``."""
    from strata_core.plugin import manager

    build = manager.build_plugin_manager

    def with_fixed(settings_):
        pm = build(settings_)
        pm.register_plugin(_plugin(placement, **hooks), name="fixed", distribution="test")
        return pm

    hooks = settings.pop("hooks", {})
    monkeypatch.setattr("strata_core.engine_load.build_plugin_manager", with_fixed)
    return Engine.load(model, strategy="fixed", devices=list(devices), max_context=128, **settings)


def test_validation_names_the_problem():
    local = tuple(LayerPlacement.local(0) for _ in range(2))
    with pytest.raises(ConfigError, match="places 1 layers"):
        Placement(local[:1], local).validate(2, 1)
    with pytest.raises(ConfigError, match="device slot 3"):
        Placement(local, local, main=3).validate(2, 2)
    no_end = (LayerPlacement(0, (ExpertSource.cache(0),)),) * 2
    with pytest.raises(ConfigError, match="must end with the arena or the CPU"):
        Placement(no_end, local).validate(2, 1)
    foreign_cache = (LayerPlacement(0, (ExpertSource.cache(1), ExpertSource.cpu())),) * 2
    with pytest.raises(ConfigError, match="use a peer source"):
        Placement(foreign_cache, local).validate(2, 2)
    self_peer = (LayerPlacement(0, (ExpertSource.peer(0), ExpertSource.cpu())),) * 2
    with pytest.raises(ConfigError, match="peer source names the computing device"):
        Placement(self_peer, local).validate(2, 2)
    chain = local[0].experts
    with pytest.raises(ConfigError, match="the attention peer names device slot 2"):
        Placement((LayerPlacement(0, chain, attention_peer=2),) * 2, local).validate(2, 2)
    for prompt, decode in (((LayerPlacement(0, chain, attention_peer=0),) * 2, local),
                           (local, (LayerPlacement(0, chain, attention_peer=1),) * 2)):
        with pytest.raises(ConfigError, match="an attention peer is another device slot, in the prompt phase"):
            Placement(prompt, decode).validate(2, 2)
    Placement((LayerPlacement(0, chain, attention_peer=1),) * 2, local).validate(2, 2)


def test_segments_are_maximal_runs():
    placement = Placement.stages([(1, range(0, 2)), (0, range(2, 5))], prompt_device=0)
    assert [(s.device, s.layers) for s in placement.segments("decode")] == [(1, range(0, 2)), (0, range(2, 5))]
    assert [(s.device, s.layers) for s in placement.segments("prompt")] == [(0, range(0, 5))]
    assert placement.cached_layers() == {1: {0, 1}, 0: {2, 3, 4}}


def test_logical_devices_each_get_a_cache_table_and_kv(model, monkeypatch):
    engine = _load(model, monkeypatch, Placement.stages([(0, range(0, 2)), (1, range(2, 4))]), expert_cache=5)
    assert sorted(engine.experts.caches) == [0, 1]
    first, second = engine.experts.tables[0], engine.experts.tables[1]
    assert first is not second and first.n_slots == second.n_slots == 5
    assert {l for l, _ in first.resident()} <= {0, 1} and {l for l, _ in second.resident()} <= {2, 3}
    session = engine.new_session()
    assert session.kv.home == {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.mark.parametrize("compute", [False, True], ids=["weights-read-across", "rows-computed-there"])
def test_a_peer_source_serves_the_peers_experts_bit_for_bit(model, monkeypatch, compute):
    """Layers computed on slot 0 find slot 1's cache first: rows equal single's, counted as peer;
    slot 1's own budget (3 slots) overrides --expert-cache."""
    chain = (ExpertSource.peer(1, compute), ExpertSource.cache(0), ExpertSource.arena(0), ExpertSource.cpu())
    layers = tuple(LayerPlacement(0, chain) for _ in range(4))
    placement = Placement(layers, layers, budgets={1: CacheBudget(slots=3)})
    engine = _load(model, monkeypatch, placement, expert_cache=6)
    assert engine.experts.tables[1].n_slots == 3 and engine.experts.tables[0].n_slots == 6
    single = Engine.load(model, max_context=128, expert_cache=0)
    assert torch.equal(engine.logits(PROMPT), single.logits(PROMPT))
    by_device = engine.telemetry.by_device()["cpu#0"]
    assert by_device["peer"] > 0 and by_device["resident"] > 0


def test_prompt_chunks_compute_logits_only_where_asked(model, monkeypatch):
    engine = Engine.load(model, max_context=128, prefill_chunk=8)
    rows = []
    real_head = engine.runner.head
    monkeypatch.setattr(engine.runner, "head", lambda hidden: rows.append(hidden.shape[0]) or real_head(hidden))
    engine.prefill(engine.new_session(), PROMPT)
    assert rows == [1]  # five chunks, one head over one position
    rows.clear()
    logits = engine.prefill(engine.new_session(), PROMPT, all_logits=True)
    assert rows == [8] * 5 and logits.shape[0] == len(PROMPT)


def test_hand_off_once_per_prompt_segment_and_back(model, monkeypatch):
    placement = Placement.stages([(0, range(0, 2)), (1, range(2, 4))], prompt_device=0)
    calls = []

    def strata_hand_off(ctx, session, layers, src, dst):
        calls.append((layers, src.index, dst.index))

    engine = _load(model, monkeypatch, placement, hooks={"strata_hand_off": strata_hand_off}, dbg_handoff=True)
    session = engine.new_session()
    engine.prefill(session, PROMPT[:20])
    assert calls == [(range(2, 4), 0, 1)] and session.kv.home == {0: 0, 1: 0, 2: 1, 3: 1}
    engine.decode_window([(session, 3)])
    engine.prefill(session, PROMPT[20:])  # the next segment: back to the prompt device first
    assert calls == [(range(2, 4), 0, 1), (range(2, 4), 1, 0), (range(2, 4), 0, 1)]


def test_dbg_handoff_catches_a_copy_that_lands_nothing(model, monkeypatch):
    placement = Placement.stages([(0, range(0, 2)), (1, range(2, 4))], prompt_device=0)

    def lossy(ctx, session, layers, src, dst):  # moves the home, drops the rows
        kvtransfer.move(session.kv, layers, dst.index, dst.device)
        for layer in layers:
            session.kv.pool_rows(layer)["k"].zero_()
        return True

    quiet = _load(model, monkeypatch, placement, hooks={"strata_hand_off": lossy})
    quiet.prefill(quiet.new_session(), PROMPT)  # not checked: silently wrong
    checked = _load(model, monkeypatch, placement, hooks={"strata_hand_off": lossy}, dbg_handoff=True)
    with pytest.raises(HandOffError, match="layer 2 from slot 0 to 1: its 'k' state read back differs"):
        checked.prefill(checked.new_session(), PROMPT)


def test_load_reports_progress_up_to_one(model):
    seen = []
    Engine.from_settings(StrataSettings(model=model, arena="pinned", max_context=64), progress=seen.append)
    assert seen == sorted(seen) and seen[0] > 0 and seen[-1] == 1.0 and len(seen) > 4  # per pinned layer too


def test_peer_stream_rows_and_adapt_swaps_are_validated():
    def placement(source, **kwargs) -> Placement:
        layers = (LayerPlacement(0, (ExpertSource.cache(0), source, ExpertSource.arena(0))),) * 2
        return Placement(layers, layers, **kwargs)

    placement(ExpertSource.peer(1, compute=True, stream=0.35, rows=64)).validate(2, 2)
    with pytest.raises(ConfigError, match="stream and rows belong to a peer that computes its rows"):
        placement(ExpertSource.peer(1, stream=0.5)).validate(2, 2)
    with pytest.raises(ConfigError, match="stream share must be in \\[0, 1\\]"):
        placement(ExpertSource.peer(1, compute=True, stream=1.5)).validate(2, 2)
    with pytest.raises(ConfigError, match="adapt swaps of slot 1 cannot be negative"):
        placement(ExpertSource.peer(1), adapt_swaps={1: -1}).validate(2, 2)
    with pytest.raises(ConfigError, match="exactly one of them"):
        CacheBudget(slots=3, reserve_mib=100)


def test_a_reserve_budget_sizes_auto_with_the_slot_s_own_reserve():
    from strata_core.experts.sizing import MIB, cache_slots

    settings = StrataSettings(reserve_mib=512)
    left = 10 * 1024 * MIB  # after the dense part and --reserve-mib
    more = cache_slots(settings, torch.device("cpu"), MIB, 100_000, None, left, CacheBudget(reserve_mib=0))
    less = cache_slots(settings, torch.device("cpu"), MIB, 100_000, None, left, CacheBudget(reserve_mib=1024))
    assert (more, less) == (10 * 1024 + 512, 10 * 1024 - 512)
