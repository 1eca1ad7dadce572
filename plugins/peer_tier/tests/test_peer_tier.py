"""peer_tier on logical devices: single's logits bit for bit with the union of both tiers, tiers
disjoint (also under adaptation) and within budget. (The peer lane and the prompt planner it drives
are core machinery, tested in tests/test_peer_rows.py and tests/test_prompt_plan.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.plugin import ConfigError
from strata_core.testing.cpu_isa import float_cpu_bodies
from strata_core.testing.residency import check_tiers, single_holds

PROMPT = list(range(5, 41))
CHECKS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


def _single(model) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """single's logits of PROMPT, of three greedy windows after it, and its greedy continuation."""
    single = Engine.load(model, max_context=128, expert_cache=0)
    return single.logits(PROMPT), _windows(single, 3), single.generate(PROMPT, max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def reference(model):
    return _single(model)


@pytest.fixture(scope="module")
def float_reference(model):
    """``reference`` with the CPU kernels' float bodies (``float_cpu_kernels``)."""
    with float_cpu_bodies():
        return _single(model)


def _windows(engine: Engine, n: int) -> list[torch.Tensor]:
    """Logits of ``n`` greedy decode windows after PROMPT."""
    session = engine.new_session()
    token, out = int(engine.prefill(session, PROMPT).argmax()), []
    for _ in range(n):
        logits = engine.decode_window([(session, token)])
        token = int(logits[0].argmax())
        out.append(logits)
    engine.release_session(session)
    return out


def _tier(model, devices=("cpu", "cpu"), **options) -> Engine:
    settings_ = {"arena": "pinned"} | {k: options.pop(k) for k in list(options) if not k.startswith("peer_")}
    return Engine.load(model, strategy="peer_tier", devices=list(devices), max_context=128,
                       strategy_options=options, **settings_)


def _held(engine: Engine, slot: int) -> set[tuple[int, int]]:
    return set(engine.experts.tables[slot].resident())


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped prefill's float product against single's kernels
@CHECKS
@example(primary=0, peer=16, chunk=40, stream=1.0, rows=-1, gather=False, grouped=True, attention=True)
@given(primary=st.integers(0, 16), peer=st.integers(1, 16), chunk=st.integers(4, 40),
       stream=st.sampled_from([0.0, 0.35, 1.0]), rows=st.sampled_from([-1, 0, 3]), gather=st.booleans(),
       grouped=st.booleans(), attention=st.booleans())
def test_logits_equal_single_holding_the_union(model, float_reference, primary, peer, chunk, stream, rows, gather,
                                               grouped, attention):
    """Random tier sizes, chunks and stream shares (prompt and decode), the decode gather, the grouped
    prefill and the peer's share of the prompt attention on or off: prompt and window logits equal
    single's bit for bit (the grouped prefill within float tolerance), the tiers are disjoint and their
    union is what single caches with both budgets."""
    engine = _tier(model, expert_cache=primary, prefill_chunk=chunk, peer_slots=peer, peer_stream_frac=stream,
                   peer_decode_stream_frac=stream, peer_prefill_rows=rows, peer_attention=attention)
    assert len(engine.model.head_splits) == (4 if attention else 0)
    engine.experts.use_gather(gather)
    engine.experts.use_grouped_prefill(grouped)
    logits = engine.logits(PROMPT)
    if grouped:
        torch.testing.assert_close(logits, float_reference[0], rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(logits, float_reference[0])
        assert all(torch.equal(a, b) for a, b in zip(_windows(engine, 3), float_reference[1]))
    assert not _held(engine, 0) & _held(engine, 1)
    assert _held(engine, 0) | _held(engine, 1) == single_holds(model, primary + peer)  # single's, both budgets
    assert engine.experts.tables[1].n_slots == min(peer, 4 * 8 - len(_held(engine, 0)))


def test_greedy_output_equals_single_and_the_peer_serves(model, reference):
    engine = _tier(model, expert_cache=4, peer_slots=6, peer_stream_frac=0.5, peer_prefill_rows=-1)
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[2]
    by_device = engine.telemetry.by_device()
    assert by_device["cpu#0"]["peer"] > 0 and by_device["cpu#1"]["streamed"] > 0


@CHECKS
@given(primary=st.integers(1, 12), peer=st.integers(1, 12), swaps=st.integers(0, 3), peer_swaps=st.integers(-1, 3),
       turns=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 255), st.integers(1, 3)), min_size=1, max_size=2))
def test_tiers_stay_disjoint_and_within_budget_under_adaptation(model, primary, peer, swaps, peer_swaps, turns):
    """Random adaptation sequences (prompts, windows, both caches swapping): never one expert in both
    tiers, each within its budget, the peer adapting only where asked."""
    engine = _tier(model, expert_cache=primary, adapt_swaps=swaps, peer_slots=peer, peer_adapt_swaps=peer_swaps,
                   arena="mmap")
    peer_before = _held(engine, 1)
    session = engine.new_session()
    for length, token, windows in turns:
        engine.prefill(session, PROMPT[:length])
        for step in range(windows):
            engine.decode_window([(session, (token + step) % 256)])
            check_tiers(engine)
    assert engine.experts.tables[0].n_resident <= primary and engine.experts.tables[1].n_resident <= peer
    if (swaps if peer_swaps < 0 else peer_swaps) == 0:
        assert _held(engine, 1) == peer_before


def test_bad_device_counts_are_named(model):
    with pytest.raises(ConfigError, match="peer_tier: --devices names the primary and the peer"):
        Engine.load(model, strategy="peer_tier", devices=["cpu"], max_context=128)


CUDA_PAIRS = ([["cuda:0", "cuda:0"]] + ([["cuda:0", "cuda:1"]] if torch.cuda.device_count() > 1 else [])
              if torch.cuda.is_available() else [])


@pytest.mark.skipif(not CUDA_PAIRS, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_PAIRS, ids=",".join)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_on_cuda_greedy_equals_single_and_a_window_does_not_sync(model, devices, graphs):
    """Eager, and with the peer's work captured in the window's CUDA graph (replays without a host sync)."""
    from strata_core.testing.sync import no_host_sync

    options = dict(max_context=128, dtype="float32", arena="pinned", cuda_graphs=graphs)
    want = Engine.load(model, devices=devices[:1], expert_cache=10, **options)
    engine = Engine.load(model, strategy="peer_tier", devices=devices, expert_cache=4,
                         strategy_options={"peer_slots": 6, "peer_stream_frac": 0.5, "peer_prefill_rows": -1},
                         **options)
    prompt = list(range(5, 90))
    assert engine.generate(prompt, max_tokens=8, temperature=0) == want.generate(prompt, max_tokens=8, temperature=0)
    torch.testing.assert_close(engine.logits(prompt), want.logits(prompt), rtol=1e-3, atol=1e-3)
    session = engine.new_session()
    engine.prefill(session, prompt)
    engine.decode_window([(session, 3)])
    with no_host_sync():
        engine.decode_window([(session, 4)])
    if graphs:
        assert engine.runner.graphs.failed is None and len(engine.runner.graphs) > 0


@pytest.mark.skipif(not CUDA_PAIRS, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_PAIRS, ids=",".join)
def test_on_cuda_bf16_decode_logits_are_single_bit_for_bit(model, devices):
    """The peer's rows join the home's combination in ``moe_decode`` (served rows), so even in bf16 every
    decode step's logits are those of one device holding the union, graphed windows included. (From
    an empty session: every position decoded, none prefilled: the grouped prefill is only close.)"""
    options = dict(max_context=128, dtype="bfloat16", arena="pinned", cuda_graphs=True)
    want = Engine.load(model, devices=devices[:1], expert_cache=10, **options)
    engine = Engine.load(model, strategy="peer_tier", devices=devices, expert_cache=4,
                         strategy_options={"peer_slots": 6}, **options)
    sessions = [(e, e.new_session()) for e in (want, engine)]
    for token in (5, 7, 11, 13, 17, 19):
        got, expected = (e.decode_window([(session, token)]) for e, session in reversed(sessions))
        assert torch.equal(got, expected)
    assert engine.runner.graphs.failed is None and len(engine.runner.graphs) > 0
