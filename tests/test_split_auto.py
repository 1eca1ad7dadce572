"""``--pcie-frac auto``: what it resolves to, the learned split balancing the link and the CPU, every
decode miss computed exactly once whatever the split, and logits bit-identical to ``--pcie-frac 1``."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.experts import split_auto
from strata_core.experts.arena import ExpertFormat
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.split_auto import (PROBE_ROWS, START_FRAC, AutoSplit, Rates, measure_rates, probe_rates,
                                            probe_split, resolve_pcie_frac, split_from_rates)
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.plugin.placement import DeviceSlot, Placement
from strata_core.tools.synthetic import PRESETS, Preset, write_synthetic

CPU, GPU = torch.device("cpu"), torch.device("cuda:0")
PRESET = Preset(n_layers=2, n_experts=8, n_experts_used=2, hidden=64, expert_ffn=32, n_heads=4,
                n_kv_heads=2, head_dim=16, vocab=320, context=512)
Q8 = ExpertFormat((Q.Q8_0,) * 3, ((32, 64), (32, 64), (64, 32)), (2176, 2176, 2176))

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    """``perf_counter`` of a test: time moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(split_auto, "time", fake)
    return fake


@pytest.mark.parametrize(("setting", "devices", "resident", "kernels", "want"), [
    (0.25, [GPU], False, True, 0.25),  # a number is itself
    ("auto", [CPU, CPU], False, True, 0.0),  # every device the CPU: computed where the misses lie
    ("auto", [GPU], True, True, 1.0),  # no misses
    ("auto", [GPU, CPU], False, False, 1.0),  # the CPU kernels do not cover the formats
    ("auto", [GPU], False, True, None),  # a GPU with misses: learned
])
def test_auto_resolves_where_the_answer_is_known(monkeypatch, setting, devices, resident, kernels, want):
    monkeypatch.setattr(split_auto, "has_cpu_kernel", lambda qtypes, shapes: kernels)
    assert resolve_pcie_frac(setting, devices, [None, Q8], resident) == want


def _window(auto: AutoSplit, clock: Clock, link_s: float, cpu_s: float, ok: bool = True) -> None:
    """One decode window of layer 0: 2 misses over the link taking ``link_s``, 3 on the CPU taking ``cpu_s``."""
    with auto.link(0, 2, CPU):
        clock.now += link_s
    auto.cpu_job(0, 3, lambda: setattr(clock, "now", clock.now + cpu_s))()
    auto.end_window(ok)


def test_the_split_balances_the_two_sides_then_settles(clock, caplog):
    auto = AutoSplit([0, 3], name="cuda:0", windows=4)
    assert auto.fracs() == {0: 0.5, 3: 0.5}
    _window(auto, clock, 100.0, 100.0)  # the warm-up: dropped
    assert auto.fracs()[0] == 0.5
    _window(auto, clock, 2.0, 9.0, ok=False)  # a failed window: dropped
    with caplog.at_level(logging.INFO, logger=split_auto.__name__):
        for _ in range(3):
            _window(auto, clock, 2.0, 9.0)  # 1 s an expert over the link, 3 s on the CPU
    assert auto.fracs() == {0: 0.75, 3: 0.5}  # the link is 3x as fast: 3/4 of the misses; layer 3 unmeasured
    assert not auto.learning
    assert auto.split(0).take(4) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["pcie-frac auto on cuda:0: link share per layer 0:0.75 3:0.50 (mean 0.62, after 4 decode "
                     "windows)"]
    job = lambda: None  # noqa: E731
    assert auto.cpu_job(0, 3, job) is job  # settled: nothing is timed any more
    _window(auto, clock, 1.0, 100.0)
    assert auto.fracs()[0] == 0.75


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("split-auto") / "tiny.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, dense_type=Q.Q8_0, progress=False)
    gguf_file = GGUFFile.open(path)
    spec = load_model_spec(gguf_file)
    weights = ExpertWeights(gguf_file, spec)
    return weights, spec, DequantExpertRows(weights)


def test_every_miss_is_computed_exactly_once_whatever_the_split(model, clock, monkeypatch):
    weights, spec, reference = model
    backend = build_expert_backend(weights, spec, Placement.stages([(0, range(spec.n_layers))]), {0: DeviceSlot(0, CPU)},
                                   StrataSettings(expert_cache=3, pcie_frac=0.5), {CPU: 0})
    rows = backend.rows_for(0)
    rows.share.auto = AutoSplit(spec.moe_layers, windows=3)  # the learned split, on the CPU
    sides: list[tuple[str, int, list[int]]] = []
    run, submit, job = rows.ring.run, rows.share.submit, rows.share._timed

    def on_link(layer, experts, consume):  # 1 ms an expert
        sides.append(("link", layer, list(experts)))
        clock.now += 0.001 * len(experts)
        return run(layer, experts, consume)

    def on_cpu(layer, experts, *args):
        sides.append(("cpu", layer, list(experts)))
        return submit(layer, experts, *args)

    def cpu_job(layer, n, fn, decoding):  # 4 ms an expert, inside the job the split times
        def slow(*args):
            clock.now += 0.004 * n
            return fn(*args)
        return job(layer, n, slow, decoding)

    monkeypatch.setattr(rows.ring, "run", on_link)
    monkeypatch.setattr(rows.share, "submit", on_cpu)
    monkeypatch.setattr(rows.share, "_timed", cpu_job)
    gen = torch.Generator().manual_seed(0)
    for window in range(6):
        backend.begin_window()
        for layer in spec.moe_layers:
            hidden = torch.randn(3, spec.hidden_size, generator=gen)  # [T, H]
            ids = torch.rand(3, spec.n_experts, generator=gen).topk(spec.n_experts_used).indices  # [T, k]
            sides.clear()
            got = rows.rows(layer, hidden, ids)
            assert torch.equal(got, reference.rows(layer, hidden, ids))
            missed = sorted(e for e in set(ids.flatten().tolist()) if backend.tables[0].host[layer, e] < 0)
            link = [e for side, _, experts in sides if side == "link" for e in experts]
            cpu = [e for side, _, experts in sides if side == "cpu" for e in experts]
            assert sorted(link + cpu) == missed  # each miss once: on one side, never both, never neither
        backend.end_window()
    assert not rows.share.auto.learning and rows.share.auto.fracs() == {layer: pytest.approx(0.8) for layer in spec.moe_layers}
    snap = backend.telemetry.snapshot()
    assert snap["experts_pcie"] > 0 and snap["experts_cpu"] > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("split-auto-engine") / "tiny-q4k.gguf"
    write_synthetic(path, PRESETS["tiny"], expert_type=Q.Q4_K, dense_type=Q.Q8_0, progress=False)
    return path


def _logits(engine: Engine) -> torch.Tensor:
    session = engine.new_session()
    logits = [engine.prefill(session, [3, 14, 15, 92, 65, 35, 89], all_logits=True)]
    logits += [engine.decode_window([(session, token)]) for token in [26, 43, 38, 32, 79, 5, 9, 11, 2, 7]]
    return torch.cat(logits)


def test_hybrid_decode_logits_equal_every_miss_over_the_link(tiny, clock, caplog):
    want = _logits(Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac=1.0))
    with caplog.at_level(logging.INFO, logger=split_auto.__name__):
        engine = Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac="auto")
    assert "pcie-frac auto: 0 (every computing device is the CPU" in caplog.text
    rows = engine.experts.rows_for(0, "decode")
    assert rows.share.auto is None and rows.share.split.frac == 0.0
    assert torch.equal(_logits(engine), want)
    rows.share.auto = AutoSplit(engine.spec.moe_layers, windows=4)  # a GPU's learned split, on the CPU
    assert torch.equal(_logits(engine), want)
    snap = engine.telemetry.snapshot()
    assert snap["experts_pcie"] > 0 and snap["experts_cpu"] > 0


@pytest.mark.parametrize(("cpu", "link", "want"), [(4.0, 55.0, 1.0), (10.0, 40.0, None), (60.0, 25.0, None)])
def test_the_measured_rates_decide_whether_the_cpu_takes_a_share(caplog, cpu, link, want):
    with caplog.at_level(logging.INFO, logger=split_auto.__name__):
        assert split_from_rates(cpu, link, "cuda:0") == want
    if want == 1.0:  # 7% for the CPU: below MIN_CPU_SHARE, every miss over the link
        assert "does not pay for the decode gather and CUDA graphs" in caplog.text
    else:
        assert f"the split starts at a link share of {link / (cpu + link):.2f}" in caplog.text


def test_the_rates_are_measured_on_the_cpu_pool_and_over_the_link(tiny, monkeypatch):
    engine = Engine.load(tiny, max_context=64, expert_cache=0, arena="pinned", pcie_frac=1.0)
    on_pool, calls = [], []
    real = split_auto.cpu_experts_ffn

    def counted(x, parts, counts, *args):
        calls.append((x.dtype, x.shape[0], len(parts), list(counts)))
        return real(x, parts, counts, *args)

    monkeypatch.setattr(split_auto, "cpu_experts_ffn", counted)
    with ThreadPoolExecutor(1, initializer=lambda: on_pool.append(True)) as pool:
        rates = measure_rates(engine.experts.arena, 0, CPU, pool, experts=3, dtype=torch.bfloat16, repeats=2)
    assert on_pool and all(0 < rate < float("inf") for rate in (rates.cpu, rates.link, rates.cpu_rows))
    # one row an expert (a decode token's share), then PROBE_ROWS (a short prompt's): a warm-up and two timed each
    assert calls == ([(torch.bfloat16, 3, 3, [1, 1, 1])] * 3
                     + [(torch.bfloat16, 3 * PROBE_ROWS, 3, [PROBE_ROWS] * 3)] * 3)


def test_the_probe_starts_a_split_from_the_measured_share_or_keeps_the_link(caplog):
    assert probe_split(Rates(cpu=30.0, link=10.0, cpu_rows=20.0), "cuda:0") == (None, 0.25)  # the CPU 3x the link
    assert probe_split(Rates(cpu=1.0, link=50.0, cpu_rows=0.5), "cuda:0")[0] == 1.0
    with caplog.at_level(logging.INFO, logger=split_auto.__name__):
        assert probe_split(None, "cuda:0") == (1.0, START_FRAC)
    assert "cuda:0: the rates are unknown: every miss goes over the link" in caplog.text


def test_a_probe_that_fails_or_has_no_kernels_gives_no_rates(tiny, monkeypatch, caplog):
    arena = Engine.load(tiny, max_context=64, expert_cache=0, arena="pinned", pcie_frac=1.0).experts.arena

    def broken(*args):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(split_auto, "measure_rates", broken)
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.INFO, logger=split_auto.__name__):
        assert probe_rates(arena, 0, CPU, pool, 2, torch.float32) is None
        monkeypatch.setattr(split_auto, "has_cpu_kernel", lambda qtypes, shapes: False)
        assert probe_rates(arena, 0, CPU, pool, 2, torch.float32) is None  # not even tried
    assert "could not be measured on cpu (RuntimeError: no pinned memory)" in caplog.text
    assert "no rate probe on cpu: the CPU kernels do not cover layer 0's expert formats" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_a_cpu_too_slow_for_a_share_leaves_the_gather_and_graphs_on(tiny, caplog, monkeypatch):
    monkeypatch.setattr(split_auto, "MIN_CPU_SHARE", 1.0)  # whatever this host measures
    with caplog.at_level(logging.INFO):
        engine = Engine.load(tiny, devices=["cuda:0"], max_context=64, expert_cache=4, arena="pinned",
                             pcie_frac="auto")
    rows = engine.experts.rows_for(0, "decode")
    assert rows.share.auto is None and rows.gather and rows.share.split.frac == 1.0
    assert "does not pay for the decode gather and CUDA graphs" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_a_gpu_with_misses_learns_its_split_then_fixes_it(tiny, caplog, monkeypatch):
    monkeypatch.setattr(split_auto, "MIN_CPU_SHARE", 0.0)  # a split whatever this host measures
    with caplog.at_level(logging.INFO):
        engine = Engine.load(tiny, devices=["cuda:0"], max_context=64, expert_cache=4, arena="pinned",
                             pcie_frac="auto")
        rows = engine.experts.rows_for(0, "decode")
        assert rows.share.auto is not None and not rows.gather  # the split is eager: no decode gather
        assert "the decode gather and CUDA graphs are off on" in caplog.text
        session = engine.new_session()
        engine.prefill(session, [3, 14, 15, 92, 65])
        for token in range(split_auto.SETTLE_WINDOWS + 2):
            engine.decode_window([(session, token + 1)])
    assert not rows.share.auto.learning and all(0 < frac < 1 for frac in rows.share.auto.fracs().values())
    assert "pcie-frac auto on" in caplog.text and "after 8 decode windows" in caplog.text
    snap = engine.telemetry.snapshot()
    assert snap["experts_pcie"] > 0 and snap["experts_cpu"] > 0
    assert engine.runner.why_not_graphed(engine.runner.segments("decode")[0]) is not None
