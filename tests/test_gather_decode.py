"""The decode gather (experts/gather.py) on the CPU: rows and logits bit-identical to the reference for
any routing and cache content, the same telemetry as the grouped path, and no host read per layer."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.experts import device_rows
from strata_core.experts.backend import build_expert_backend
from strata_core.ops.gather import gather_experts
from strata_core.testing.sync import HostReads
from strata_core.plugin.placement import DeviceSlot, Placement

CPU = torch.device("cpu")
PROMPT = list(range(7, 30))
DECODE = [40, 41, 42, 43]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine_model(tiny_model_factory):
    return tiny_model_factory(expert_type="Q4_0", n_layers=3)


def _backend(synthetic, **options):
    weights, spec, _ = synthetic
    placement = Placement.stages([(0, range(spec.n_layers))])
    return build_expert_backend(weights, spec, placement, {0: DeviceSlot(0, CPU)}, StrataSettings(**options), {CPU: 0})


def test_gather_op_reads_slots_for_hits_and_the_arena_for_misses():
    slots = torch.arange(3 * 10, dtype=torch.uint8).view(3, 10)  # [S, B]
    arena = torch.arange(100, 100 + 4 * 8, dtype=torch.uint8).view(4, 8)  # [E, 8]
    slot = torch.tensor([2, -1, 0, -1], dtype=torch.int32)
    expert = torch.tensor([1, 3, 0, 3])
    out = gather_experts(slots, arena, slot, expert, 8)
    assert torch.equal(out, torch.stack([slots[2, :8], arena[3], slots[0, :8], arena[3]]))
    assert torch.equal(gather_experts(slots[:0], arena, slot.clamp_max(-1), expert, 8), arena[expert])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.integers(0, 32), seed=st.integers(0, 2**16), windows=st.lists(st.integers(1, 5), min_size=1,
                                                                                max_size=3))
def test_gather_rows_are_the_reference_bits(synthetic, slots, seed, windows):
    """Random cache contents and routings: every gathered row has the reference's bits."""
    _, spec, reference = synthetic
    backend = _backend(synthetic, expert_cache=slots, arena="pinned")
    cache = backend.caches[0]
    rng = random.Random(seed)
    for entry in cache.table.resident():
        cache.table.evict(*entry)
    everything = [(l, e) for l in range(spec.n_layers) for e in range(spec.n_experts)]
    cache.fill(rng.sample(everything, len(everything)))
    backend.use_gather(True)
    rows = backend.rows_for(0)
    gen = torch.Generator().manual_seed(seed)
    for T in windows:
        backend.begin_window()
        for layer in range(spec.n_layers):
            hidden = torch.randn(T, spec.hidden_size, generator=gen)  # [T, H]
            ids = torch.rand(T, spec.n_experts, generator=gen).topk(spec.n_experts_used).indices  # [T, k]
            assert torch.equal(rows.rows(layer, hidden, ids), reference.rows(layer, hidden, ids))
        backend.end_window()


def _run(engine: Engine) -> torch.Tensor:
    """Prompt logits, then decode windows of one session and of two sessions together."""
    first, second = engine.new_session(), engine.new_session()
    logits = [engine.prefill(first, PROMPT, all_logits=True), engine.prefill(second, PROMPT[:9], all_logits=True)]
    for token in DECODE:
        logits.append(engine.decode_window([(first, token)]))
        logits.append(engine.decode_window([(first, token + 1), (second, token + 2)]))
    return torch.cat(logits)


@pytest.mark.parametrize("slots", [0, 7, 24])
def test_gather_logits_and_telemetry_match_the_grouped_path(engine_model, slots):
    """Through the engine: identical logits over prefill + decode windows; same hit/miss counts."""
    grouped = Engine.load(engine_model, max_context=64, expert_cache=slots, arena="pinned")
    gathered = Engine.load(engine_model, max_context=64, expert_cache=slots, arena="pinned")
    gathered.experts.use_gather(True)
    assert torch.equal(_run(gathered), _run(grouped))
    mine, theirs = gathered.telemetry.snapshot(), grouped.telemetry.snapshot()
    for key in ("expert_hits", "expert_misses", "experts_resident", "experts_streamed"):
        assert mine[key] == theirs[key], key
    assert mine["experts_pcie"] == theirs["experts_pcie"]  # distinct (layer, expert) per layer in both
    # the grouped path copies each missed expert once per layer, the gather once per missed pair
    assert mine["bytes_streamed"] >= theirs["bytes_streamed"]
    if slots == 0:
        assert mine["expert_hits"] == 0 and mine["experts_pcie"] > 0


def test_gather_needs_a_fully_pinned_arena(engine_model):
    for options in ({"arena": "mmap"}, {"arena": "pinned", "pin_limit_gib": 1e-6}):
        engine = Engine.load(engine_model, max_context=64, **options)
        with pytest.raises(ConfigError, match="arena pinned"):
            engine.experts.use_gather(True)
        assert not engine.experts.rows_for(0).gather  # never chosen on the CPU by itself


@pytest.mark.parametrize("gather", [True, False])
def test_no_host_read_per_layer_in_a_gathered_window(engine_model, monkeypatch, gather):
    """Inside the expert rows of a decode window the gather reads nothing back to the host; the
    grouped path does (so the counting can fail)."""
    engine = Engine.load(engine_model, max_context=64, expert_cache=5, arena="pinned")
    engine.experts.use_gather(gather)
    session = engine.new_session()
    engine.prefill(session, PROMPT)
    rows = engine.experts.rows_for(0)
    reads = HostReads(monkeypatch)
    reads.watch(device_rows, "group_by_expert")
    real_rows = rows.rows

    def counted_rows(*args):
        with reads.counting():
            return real_rows(*args)

    monkeypatch.setattr(rows, "rows", counted_rows)
    engine.decode_window([(session, 50)])
    engine.decode_window([(session, 51)])
    if gather:
        assert reads.reads == []
    else:
        assert reads.reads.count("group_by_expert") == 2 * engine.spec.n_layers


def test_a_padded_windows_rows_are_not_counted():
    """With ``live``, the pairs past it (a window padded to its graph's batch size) add nothing to the
    usage counts or the gather telemetry: the counts equal those of the live pairs alone."""
    from strata_core.experts.gather import count_pairs, lookup_slots

    gen = torch.Generator().manual_seed(3)
    resident = torch.where(torch.rand(64, generator=gen) < 0.5, torch.arange(64), -1).to(torch.int32)
    expert = torch.randint(0, 64, (40,), generator=gen)
    alone_usage, alone_counters = torch.zeros(64, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    slot = lookup_slots(expert[:24], resident, alone_usage, alone_counters, 100)
    usage, counters = torch.zeros(64, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    padded = lookup_slots(expert, resident, usage, counters, 100, torch.tensor([24]))
    assert torch.equal(padded[:24], slot) and torch.equal(padded, resident[expert])
    assert torch.equal(usage, alone_usage) and torch.equal(counters, alone_counters)
    assert counters.sum() > 0 and usage.sum() == 24
    count_pairs(padded, expert, resident, counters, 100, torch.tensor([0]))
    assert torch.equal(counters, alone_counters)


@pytest.mark.parametrize(("slots", "prompt", "loop_layers"), [(24, 23, 0), (24, 65, 3), (23, 23, 1)])
def test_a_short_prompt_on_fully_resident_layers_takes_the_gather(engine_model, monkeypatch, slots, prompt,
                                                                   loop_layers):
    """A prompt chunk of at most GATHER_PROMPT_TOKENS tokens goes per pair, with no host read of its routing,
    through every layer whose experts are all resident (3 layers of 8 experts: 23 slots leave one layer a
    miss); a longer chunk takes the prompt path, which reads each layer's routing."""
    assert device_rows.GATHER_PROMPT_TOKENS == 64
    engine = Engine.load(engine_model, max_context=128, expert_cache=slots, arena="pinned")
    engine.experts.use_gather(True)
    reads = HostReads(monkeypatch)
    reads.watch(device_rows, "group_by_expert")
    reads.watch(device_rows, "held_slots")  # the CPU's slot rows read the routing there instead
    reads.watch(device_rows, "routed_experts")  # or there, where the routing is in their call
    with reads.counting():
        engine.prefill(engine.new_session(), list(range(3, 3 + prompt)))
    assert sum(reads.reads.count(name) for name in ("group_by_expert", "held_slots", "routed_experts")) == loop_layers
