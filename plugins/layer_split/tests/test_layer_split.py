"""layer_split on logical devices: single's logits bit for bit, micro-batched windows, per-stage
timing, and caches that never hold an expert twice. (The host reads of a window across stages are
counted in tests/test_stage_host_reads.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_layer_split.plugin import micro_batches, stage_ranges

from strata_core.engine import Engine
from strata_core.plugin import ConfigError, DecodeBatch, DeviceSlot
from strata_core.testing.models import tiny_spec
from strata_core.testing.residency import check_tiers

PROMPT = list(range(5, 41))
CPU2 = [DeviceSlot(0, torch.device("cpu")), DeviceSlot(1, torch.device("cpu"))]
CHECKS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


@pytest.fixture(scope="module")
def reference(model):
    """single's logits of PROMPT, and its greedy continuation."""
    single = Engine.load(model, max_context=128, expert_cache=0)
    return single.logits(PROMPT), single.generate(PROMPT, max_tokens=6, temperature=0)


def _split(model, cut: int, **settings) -> Engine:
    return Engine.load(model, strategy="layer_split", devices=["cpu", "cpu"], max_context=128,
                       strategy_options={"split": str(cut)}, **settings)


@CHECKS
@given(cut=st.integers(1, 3), cache=st.integers(0, 16), chunk=st.integers(1, 40))
def test_logits_equal_single_for_any_cut_cache_and_chunk(model, reference, cut, cache, chunk):
    engine = _split(model, cut, expert_cache=cache, prefill_chunk=chunk)
    assert [s.layers for s in engine.runner.segments("decode")] == [range(0, cut), range(cut, 4)]
    assert torch.equal(engine.logits(PROMPT), reference[0])


def test_greedy_output_equals_single(model, reference):
    assert _split(model, 2, expert_cache=5).generate(PROMPT, max_tokens=6, temperature=0) == reference[1]


def test_auto_cuts_by_memory_and_bad_splits_are_named(tiny_model_factory):
    spec = tiny_spec(tiny_model_factory(n_layers=8))
    assert stage_ranges(CPU2, spec, "auto") == [(0, range(0, 4)), (1, range(4, 8))]  # cpu,cpu share RAM
    assert stage_ranges(CPU2, spec, "3") == [(0, range(0, 3)), (1, range(3, 8))]
    for bad in ("0", "8", "2,5", "x"):
        with pytest.raises(ConfigError, match="layer_split"):
            stage_ranges(CPU2, spec, bad)
    with pytest.raises(ConfigError, match="layer_split: --devices names one device .*needs two or more"):
        stage_ranges(CPU2[:1], spec, "auto")


def _decode(engine: Engine, prompts: list[list[int]], windows: int) -> list[torch.Tensor]:
    sessions = [engine.new_session() for _ in prompts]
    tokens = [int(engine.prefill(s, p).argmax()) for s, p in zip(sessions, prompts)]
    out = []
    for _ in range(windows):
        logits = engine.decode_window(list(zip(sessions, tokens)))
        tokens = [int(row.argmax()) for row in logits]
        out.append(logits)
    return out


def test_micro_batched_windows_equal_single_and_run_each_stage_per_micro_batch(model, monkeypatch):
    prompts = [PROMPT[:9], PROMPT[3:20], PROMPT[10:14]]
    want = _decode(Engine.load(model, max_context=128, expert_cache=3), prompts, 3)
    engine = _split(model, 2, expert_cache=3)
    calls = []
    real = engine.runner.decode_segment
    monkeypatch.setattr(engine.runner, "decode_segment",
                        lambda segment, hidden, batch: calls.append((segment.device, len(batch))) or
                        real(segment, hidden, batch))
    got = _decode(engine, prompts, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls[:4] == [(0, 2), (0, 1), (1, 2), (1, 1)]  # stage-major: stage 0 runs both first
    five = DecodeBatch(tuple(engine.new_session() for _ in range(5)), torch.arange(5))
    parts = micro_batches(five, 2)
    assert [len(p) for p in parts] == [2, 3] and torch.equal(torch.cat([p.tokens for p in parts]), five.tokens)


def test_decode_timing_prints_each_stage(model, capsys):
    engine = _split(model, 1, decode_timing=True)
    session = engine.new_session()
    engine.prefill(session, PROMPT[:5])
    engine.decode_window([(session, 7)])
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[strata decode]")]
    assert "[decode cpu#0[0..0]]=" in line and "[decode cpu#1[1..3]]=" in line and "host=" in line


@CHECKS
@given(cut=st.integers(1, 3), cache=st.integers(1, 12), swaps=st.integers(1, 4),
       windows=st.lists(st.integers(0, 255), min_size=1, max_size=4))
def test_caches_never_hold_an_expert_twice_also_after_adaptation(model, cut, cache, swaps, windows):
    engine = _split(model, cut, expert_cache=cache, adapt_swaps=swaps)
    session = engine.new_session()
    engine.prefill(session, PROMPT[:10])
    for token in windows:
        engine.decode_window([(session, token)])
        check_tiers(engine)
        assert all(table.n_resident <= cache for table in engine.experts.tables.values())


CUDA_PAIRS = ([["cuda:0", "cuda:0"]] + ([["cuda:0", "cuda:1"]] if torch.cuda.device_count() > 1 else [])
              if torch.cuda.is_available() else [])


@pytest.mark.skipif(not CUDA_PAIRS, reason="needs a CUDA device")
@pytest.mark.parametrize("devices", CUDA_PAIRS, ids=",".join)
def test_on_cuda_graphs_per_stage_replay_without_host_sync_and_match_single(model, devices):
    from strata_core.testing.sync import no_host_sync

    prompts = [list(range(5, 60)), list(range(70, 90)), list(range(20, 30))]
    options = dict(max_context=128, dtype="float32", arena="pinned", cuda_graphs=True)
    want = _decode(Engine.load(model, devices=devices[:1], expert_cache=8, **options), prompts, 6)
    engine = Engine.load(model, strategy="layer_split", devices=devices, expert_cache=4,
                         strategy_options={"split": "2"}, **options)
    got = _decode(engine, prompts, 6)
    assert [row.argmax(-1).tolist() for row in got] == [row.argmax(-1).tolist() for row in want]
    graphs = engine.runner.graphs
    assert graphs.failed is None and graphs.captures == 4  # two stages x two micro-batches
    sessions = [engine.new_session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        engine.prefill(session, prompt)
    engine.decode_window([(s, 3) for s in sessions])  # captures for these sessions
    with no_host_sync():
        engine.decode_window([(s, 4) for s in sessions])


def test_auto_cuts_weigh_the_memory_other_ranks_reported(tiny_model_factory):
    spec = tiny_spec(tiny_model_factory(n_layers=8))
    gib = 1 << 30
    ranked = [DeviceSlot(0, torch.device("cpu"), rank=1, memory=1 * gib),
              DeviceSlot(1, torch.device("cpu"), rank=2, memory=3 * gib)]
    assert stage_ranges(ranked, spec, "auto") == [(0, range(0, 2)), (1, range(2, 8))]
    ranked = [DeviceSlot(0, torch.device("cpu"), rank=1, memory=3 * gib),
              DeviceSlot(1, torch.device("cpu"), rank=2, memory=1 * gib)]
    assert stage_ranges(ranked, spec, "auto") == [(0, range(0, 6)), (1, range(6, 8))]
