"""prefill_main on logical devices: single's logits bit for bit, residency masked in place for the
prompt and restored (also on error), one hand-off per prompt segment, the widest link first."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_prefill_main import plugin as prefill_main

from strata_core.engine import Engine
from strata_core.plugin import DeviceSlot, hookimpl
from strata_core.testing.residency import check_tiers

PROMPT = list(range(5, 41))
CHECKS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


@pytest.fixture(scope="module")
def reference(model):
    single = Engine.load(model, max_context=128, expert_cache=0)
    return single.logits(PROMPT), single.generate(PROMPT, max_tokens=6, temperature=0)


def _engine(model, cut: int, peer_read: bool = True, **settings) -> Engine:
    return Engine.load(model, strategy="prefill_main", devices=["cpu", "cpu"], max_context=128,
                       strategy_options={"split": str(cut), "peer_read": peer_read}, **settings)


@CHECKS
@given(cut=st.integers(1, 3), cache=st.integers(0, 16), chunk=st.integers(1, 40), peer_read=st.booleans())
def test_logits_equal_single_for_any_cut_cache_chunk(model, reference, cut, cache, chunk, peer_read):
    engine = _engine(model, cut, peer_read, expert_cache=cache, prefill_chunk=chunk, dbg_handoff=True)
    assert [s.layers for s in engine.runner.segments("prompt")] == [range(0, 4)]
    assert [s.layers for s in engine.runner.segments("decode")] == [range(0, cut), range(cut, 4)]
    assert torch.equal(engine.logits(PROMPT), reference[0])


@pytest.mark.parametrize("peer_read", [True, False])
def test_greedy_output_equals_single(model, reference, peer_read):
    engine = _engine(model, 2, peer_read, expert_cache=6, dbg_handoff=True)
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[1]
    assert engine.telemetry.by_device()["cpu#0"]["peer" if peer_read else "streamed"] > 0


class _Watch:
    """An observer plugin: what the prompt path sees of each table, and the residency events."""

    def __init__(self, engine: Engine, fail_at_layer: int | None = None):
        self.engine, self.fail_at_layer, self.events, self.seen = engine, fail_at_layer, [], []
        module = types.ModuleType("watch")
        module.strata_residency = hookimpl(lambda ctx, event: self.events.append(event))

        def strata_prefill(ctx, batch, logits):
            with ctx.observe_layers(self._layer):
                return (yield)

        module.strata_prefill = hookimpl(wrapper=True)(strata_prefill)
        engine.plugins.register(module, name="watch")

    def _layer(self, layer: int, hidden: torch.Tensor) -> None:
        self.seen.append({slot: (t.host.clone(), t.mirror.clone()) for slot, t in self.engine.experts.tables.items()})
        if layer == self.fail_at_layer:
            raise RuntimeError("a layer failed")


def _tables(engine: Engine) -> dict[int, torch.Tensor]:
    return {slot: table.host.clone() for slot, table in engine.experts.tables.items()}


@CHECKS
@given(cut=st.integers(1, 3), cache=st.integers(1, 16),
       steps=st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(1, 12)), min_size=1, max_size=5))
def test_masking_hides_foreign_slots_from_the_prompt_and_restores_them(model, cut, cache, steps):
    """Random interleavings of prompts and windows over three sessions, without a peer link: while
    a prompt runs, no entry of the later stage's table is visible (host and device mirror); after
    each request both tables equal what they were; events pair mask with restore."""
    engine = _engine(model, cut, peer_read=False, expert_cache=cache)
    watch = _Watch(engine)
    before = _tables(engine)
    sessions = [engine.new_session() for _ in range(3)]
    for which, prompt, length in steps:
        session = sessions[which]
        if prompt or session.n_tokens == 0:
            engine.prefill(session, PROMPT[:length])
        else:
            engine.decode_window([(session, length)])
        assert all(torch.equal(a, b) for a, b in zip(_tables(engine).values(), before.values()))
    for tables in watch.seen:
        host, mirror = tables[1]
        assert bool((host[cut:] < 0).all()) and bool((mirror[cut:] < 0).all())
    kinds = [event.kind for event in watch.events]
    assert kinds == ["mask", "restore"] * (len(kinds) // 2)
    masks = [event for event in watch.events if event.kind == "mask"]
    assert all(event.device.index == 1 and {l for l, _ in event.entries} <= set(range(cut, 4)) for event in masks)


def test_an_exception_in_the_middle_of_a_prompt_restores_the_tables(model):
    engine = _engine(model, 2, peer_read=False, expert_cache=8)
    before = _tables(engine)
    watch = _Watch(engine, fail_at_layer=3)
    with pytest.raises(RuntimeError, match="a layer failed"):
        engine.prefill(engine.new_session(), PROMPT)
    assert bool((watch.seen[-1][1][0][2:] < 0).all())  # it was masked when the layer failed
    assert all(torch.equal(a, b) for a, b in zip(_tables(engine).values(), before.values()))
    assert [event.kind for event in watch.events] == ["mask", "restore"]
    for table in engine.experts.tables.values():
        table.check()


def test_the_later_stage_caches_its_own_layers_only(model):
    engine = _engine(model, 2, expert_cache=16)
    assert {l for l, _ in engine.experts.tables[0].resident()} == {0, 1}
    assert {l for l, _ in engine.experts.tables[1].resident()} == {2, 3}


@CHECKS
@given(cut=st.integers(1, 3), cache=st.integers(1, 12), swaps=st.integers(1, 4), peer_read=st.booleans(),
       turns=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 255)), min_size=1, max_size=3))
def test_tiers_stay_disjoint_through_prompts_and_adaptation(model, cut, cache, swaps, peer_read, turns):
    """Prompts (masked or read across) and decode windows that adapt both caches, interleaved."""
    engine = _engine(model, cut, peer_read, expert_cache=cache, adapt_swaps=swaps)
    session = engine.new_session()
    for length, token in turns:
        engine.prefill(session, PROMPT[:length])
        engine.decode_window([(session, token)])
        check_tiers(engine)


def test_the_widest_host_link_becomes_main(monkeypatch, caplog):
    slots = [DeviceSlot(i, torch.device("cuda", i)) for i in range(3)]
    links = {0: (4, 4), 1: (5, 16), 2: (5, 8)}
    monkeypatch.setattr(prefill_main, "link_class", lambda device: links[device.index])
    with caplog.at_level("INFO"):
        assert [s.index for s in prefill_main.by_link(slots)] == [1, 0, 2]
    assert "cuda:1#1 has the widest host link (PCIe gen 5 x16)" in caplog.text
    monkeypatch.setattr(prefill_main, "link_class", lambda device: None)  # the probe fails: as configured
    assert prefill_main.by_link(slots) == slots


def test_across_ranks_the_order_stays_and_peer_read_is_off_or_refused(model, monkeypatch):
    """Another rank's stage: no link probe reorders the devices (every rank must place alike), the
    prompt streams the later stage's layers instead of reading its cache, and peer_read=true is refused."""
    from strata_core.plugin import ConfigError
    from strata_core.testing.models import tiny_spec

    spec = tiny_spec(model)
    slots = [DeviceSlot(0, torch.device("cuda", 0)), DeviceSlot(1, torch.device("cuda", 1), rank=1)]
    monkeypatch.setattr(prefill_main, "link_class", lambda device: (5, 16) if device.index == 1 else (4, 4))
    placement = prefill_main.strata_topology(slots, spec, None, prefill_main.PrefillMainOptions(split="2"))
    assert placement.main == 0 and {p.device for p in placement.prompt} == {0}
    assert all(source.kind != "peer" for p in placement.prompt for source in p.experts)
    assert prefill_main.strata_topology(slots[:1] + [DeviceSlot(1, torch.device("cuda", 1))], spec, None,
                                        prefill_main.PrefillMainOptions(split="2")).main == 1  # one process: reordered
    with pytest.raises(ConfigError, match="peer_read=true reads the later stages' caches across a peer link, and "
                                          "rank1:cuda:1#1 is another rank's device"):
        prefill_main.strata_topology(slots, spec, None, prefill_main.PrefillMainOptions(split="2", peer_read=True))


def test_a_saved_session_restores_and_decodes_like_the_original(model):
    engine = _engine(model, 2, expert_cache=4)
    session = engine.new_session()
    engine.prefill(session, PROMPT[:20])
    restored = engine.restore_session(engine.save_session(session))
    assert torch.equal(engine.decode_window([(session, 7)]), engine.decode_window([(restored, 7)]))
    assert restored.kv.home == session.kv.home == {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped prefill's float product against single's kernels
def test_the_grouped_prefill_reads_peer_slots(model):
    """The grouped prefill (the CUDA prompt path, forced here) takes the later stage's experts
    from its slots: logits within float tolerance of single's, peer groups counted."""
    engine = _engine(model, 2, expert_cache=8)
    engine.experts.use_grouped_prefill(True)
    single = Engine.load(model, max_context=128, expert_cache=0).logits(PROMPT)  # ``reference``'s, float bodies
    torch.testing.assert_close(engine.logits(PROMPT), single, rtol=1e-4, atol=1e-4)
    assert engine.telemetry.by_device()["cpu#0"]["peer"] > 0


CUDA_PAIRS = ([["cuda:0", "cuda:0"]] + ([["cuda:0", "cuda:1"]] if torch.cuda.device_count() > 1 else [])
              if torch.cuda.is_available() else [])


@pytest.mark.skipif(not CUDA_PAIRS, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_PAIRS, ids=",".join)
def test_on_cuda_greedy_equals_single(model, devices):
    prompt = list(range(5, 120))
    options = dict(max_context=256, dtype="float32", arena="pinned")
    single = Engine.load(model, devices=devices[:1], expert_cache=16, **options)
    engine = Engine.load(model, strategy="prefill_main", devices=devices, expert_cache=8, dbg_handoff=True,
                         strategy_options={"split": "2"}, **options)
    assert engine.generate(prompt, max_tokens=12, temperature=0) == single.generate(prompt, max_tokens=12,
                                                                                    temperature=0)
    assert engine.telemetry.by_device()[f"{devices[0]}#0"]["peer"] > 0
