"""Short prompt chunks' misses split between the link and the CPU as the decode splits them: the
threshold (``cpu_prompt_tokens``) from the measured rates, logits bit-identical to every miss over the
link on the CPU, longer chunks streaming as before, and every miss computed exactly once."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.experts import backend as expert_backend
from strata_core.experts import prompt_split, split_auto
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.prompt_split import (cpu_prompt_tokens, cpu_seconds_per_gb, decide_cpu_prompt_tokens,
                                              rows_per_expert)
from strata_core.experts.split import MissSplit
from strata_core.experts.split_auto import PROBE_ROWS, AutoSplit, Rates
from strata_core.plugin.placement import DeviceSlot, Placement
from strata_core.tools.synthetic import PRESETS, write_synthetic

CPU = torch.device("cpu")
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
DECODE = [26, 43, 38, 32, 79]
#: Qwen3-30B-A3B's routing: 8 of 128 experts a token
E, K = 128, 8

pytestmark = pytest.mark.usefixtures("one_thread")

rates_st = st.builds(lambda cpu, link, slower: Rates(cpu=cpu, link=link, cpu_rows=cpu / slower),
                     st.floats(0.1, 500.0), st.floats(0.1, 500.0), st.floats(0.5, 50.0))
routing_st = st.integers(2, 512).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e)))


# --- the threshold, a pure function of the rates ---------------------------------------------------------------


def test_rows_per_expert_follow_the_routing():
    assert rows_per_expert(1, E, K) == pytest.approx(1.0)  # one token: every routed expert once
    assert rows_per_expert(40, 4, 4) == pytest.approx(40.0)  # every expert routed by every token
    assert rows_per_expert(2048, E, K) == pytest.approx(2048 * K / E)  # every expert routed, the pairs shared out
    assert [rows_per_expert(t, E, K) for t in (1, 16, 64, 256)] == sorted(rows_per_expert(t, E, K)
                                                                           for t in (1, 16, 64, 256))


def test_the_cpu_wins_the_chunks_whose_rows_it_computes_before_the_link_streams_them():
    """A desktop with every miss on the CPU (``--pcie-frac 0``): the CPU at 30 GB/s at one row an expert
    and 10 GB/s at 16, a 25 GB/s link. The CPU's seconds per GB, 1/30 + (1/10 - 1/30) (r - 1) / 15, stay
    below the link's 1/25 while a routed expert gets fewer than 2.5 rows."""
    rates = Rates(cpu=30.0, link=25.0, cpu_rows=10.0)
    tokens = cpu_prompt_tokens(rates, 0.0, E, K, limit=8192)
    assert tokens > 0
    assert rows_per_expert(tokens, E, K) < 2.5 <= rows_per_expert(tokens + 1, E, K)
    assert cpu_seconds_per_gb(rates, 2.5) == pytest.approx(1 / 25)
    assert cpu_prompt_tokens(rates, 0.0, E, K, limit=3) == 3  # never past a chunk


def test_the_cpu_loses_where_one_row_an_expert_is_slower_than_the_link():
    """The H100 host's figures (BENCHMARKS.md): the CPU at 5.7 GB/s, the link at 38: with every miss on the
    CPU not even a one-token chunk gains; the decode keeps every miss on the link there (a CPU share of 13%
    is below ``MIN_CPU_SHARE``), and so do prompts."""
    rates = Rates(cpu=5.7, link=38.0, cpu_rows=4.0)
    assert cpu_prompt_tokens(rates, 0.0, E, K, limit=8192) == 0
    assert split_auto.split_from_rates(rates.cpu, rates.link) == 1.0
    assert cpu_prompt_tokens(rates, 1.0, E, K, limit=8192) == 0


@given(rates=rates_st, share=st.floats(0.0, 1.0), routing=routing_st, limit=st.integers(1, 8192))
def test_the_threshold_is_the_longest_chunk_the_model_says_the_split_wins(rates, share, routing, limit):
    n_experts, n_used = routing
    tokens = cpu_prompt_tokens(rates, share, n_experts, n_used, limit)

    def wins(t: int) -> bool:  # the CPU's share at t tokens' rows before the link streams every miss
        rows = rows_per_expert(t, n_experts, n_used)
        return rows <= PROBE_ROWS and (1 - share) * cpu_seconds_per_gb(rates, rows) < 1 / rates.link

    assert 0 <= tokens <= limit
    if share == 1.0:
        assert tokens == 0  # the decode sends nothing to the CPU: neither do prompts
        return
    if tokens:
        assert all(wins(t) for t in [*range(1, tokens, max(tokens // 8, 1)), tokens])  # every shorter chunk wins too
    assert tokens == limit or not wins(tokens + 1)


@given(rates=rates_st, share=st.floats(0.0, 0.99), routing=routing_st, faster=st.floats(1.0, 10.0))
def test_a_faster_cpu_never_shortens_the_threshold_and_a_faster_link_never_lengthens_it(rates, share, routing,
                                                                                       faster):
    n_experts, n_used = routing
    tokens = cpu_prompt_tokens(rates, share, n_experts, n_used, 8192)
    quicker_cpu = Rates(cpu=rates.cpu * faster, link=rates.link, cpu_rows=rates.cpu_rows * faster)
    quicker_link = Rates(cpu=rates.cpu, link=rates.link * faster, cpu_rows=rates.cpu_rows)
    assert cpu_prompt_tokens(quicker_cpu, share, n_experts, n_used, 8192) >= tokens
    assert cpu_prompt_tokens(quicker_link, share, n_experts, n_used, 8192) <= tokens


@given(rates=rates_st, routing=routing_st)
def test_under_auto_a_one_token_chunk_always_splits(rates, routing):
    """With the share ``auto`` balances (the CPU's share of the speed), a one-row-an-expert chunk's CPU side
    takes 1 / (CPU + link) of the time per GB, less than the link's 1 / link."""
    share = 1.0 - rates.cpu / (rates.cpu + rates.link)
    assert cpu_prompt_tokens(rates, share, *routing, limit=8192) >= 1


def test_the_decision_is_logged_with_the_rates_it_came_from(caplog):
    with caplog.at_level(logging.INFO, logger=prompt_split.__name__):
        tokens = decide_cpu_prompt_tokens(Rates(cpu=30.0, link=25.0, cpu_rows=10.0), 0.0, E, K, 8192, "cuda:0")
        assert decide_cpu_prompt_tokens(Rates(cpu=5.7, link=38.0, cpu_rows=4.0), 0.0, E, K, 8192, "cuda:1") == 0
        assert decide_cpu_prompt_tokens(None, 0.5, E, K, 8192, "cuda:2") == 0
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == (f"cpu prompt tokens on cuda:0: {tokens} (a prompt chunk of at most that many tokens splits "
                        "its misses as the decode does, 0.00 over the link; a longer one streams them all): the CPU "
                        "computes misses at 30.0 GB/s at one row an expert and 10.0 GB/s at 16 rows, the link moves "
                        "them at 25.0 GB/s")
    assert lines[1].startswith("cpu prompt tokens on cuda:1: 0 (every prompt chunk streams its misses; the decode "
                               "sends 0.00 of them over the link): the CPU computes misses at 5.7 GB/s")
    assert lines[2] == "cpu prompt tokens on cuda:2: 0 (the CPU's rate is unknown: prompt chunks stream every miss)"


# --- the engine on the CPU: a GPU's split of short prompts, forced --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt-split") / "tiny-q4k.gguf"
    write_synthetic(path, PRESETS["tiny"], expert_type=Q.Q4_K, dense_type=Q.Q8_0, progress=False)
    return path


def _short_prompts(engine: Engine, tokens: int) -> None:
    """What the backend does on a GPU whose probe chose ``tokens``: the prompt rows follow the decode's split."""
    rows = engine.experts.rows_for(0, "prompt")
    rows.share.follow(tokens, engine.experts.rows_for(0, "decode").share)


def _logits(engine: Engine, prompt_cpu: list[int]) -> torch.Tensor:
    """Prompt logits, then decode windows of one session; the experts the prompt computed on the CPU added to
    ``prompt_cpu``."""
    session = engine.new_session()
    engine.telemetry.reset()
    logits = [engine.prefill(session, PROMPT, all_logits=True)]
    prompt_cpu.append(engine.telemetry.snapshot()["experts_cpu"])
    logits += [engine.decode_window([(session, token)]) for token in DECODE]
    return torch.cat(logits)


def test_a_cpu_device_keeps_the_feature_off(tiny):
    for frac in ("auto", 0.5, 1.0):
        engine = Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac=frac)
        assert engine.experts.cpu_prompt_tokens == 0 and engine.experts.rows_for(0, "prompt").share.cpu_prompt_tokens == 0
        engine.prefill(engine.new_session(), PROMPT)
        assert engine.telemetry.snapshot()["experts_cpu"] == 0  # the prompt's misses all streamed


@pytest.mark.parametrize("split", ["fixed", "learned"])
def test_a_short_prompt_through_the_cpu_gives_the_bits_of_every_miss_over_the_link(tiny, split):
    want = _logits(Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac=1.0), [])
    engine = Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac=0.5)
    if split == "learned":  # a GPU's per-layer split, on the CPU
        engine.experts.rows_for(0, "decode").share.auto = AutoSplit(engine.spec.moe_layers, windows=3)
    _short_prompts(engine, len(PROMPT))
    prompt_cpu: list[int] = []
    assert torch.equal(_logits(engine, prompt_cpu), want)
    assert prompt_cpu[0] > 0  # the prompt did compute misses on the CPU


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_a_chunk_longer_than_the_threshold_streams_every_miss(tiny, monkeypatch, grouped):
    """The threshold counts a prompt pass's tokens: one prompt's, or a batch's together. With the grouped
    prefill on (a GPU's), a short chunk takes the decode's loop instead, a long one the grouped prefill."""
    engine = Engine.load(tiny, max_context=64, expert_cache=5, pcie_frac=0.5)
    engine.experts.use_grouped_prefill(grouped)
    _short_prompts(engine, 6)
    rows = engine.experts.rows_for(0, "prompt")
    grouped_layers = []
    real = rows._grouped
    monkeypatch.setattr(rows, "_grouped", lambda layer, *args: grouped_layers.append(layer) or real(layer, *args))
    for chunks, splits in (([PROMPT[:6]], True), ([PROMPT[:7]], False), ([PROMPT[:3], PROMPT[3:6]], True),
                           ([PROMPT[:3], PROMPT[3:7]], False)):
        engine.telemetry.reset()
        grouped_layers.clear()
        engine.prefill_batch([(engine.new_session(), chunk) for chunk in chunks])
        snap = engine.telemetry.snapshot()
        assert (snap["experts_cpu"] > 0) == splits, chunks
        assert snap["experts_pcie"] == 0  # a prompt's link share counts as streamed
        assert grouped_layers == ([] if splits or not grouped else list(engine.spec.moe_layers))


# --- the bookkeeping of one layer's prompt misses --------------------------------------------------------------


@settings(max_examples=30)
@given(tokens=st.integers(1, 12), threshold=st.integers(0, 12), frac=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
       slots=st.integers(0, 24), seed=st.integers(0, 2 ** 16))
def test_every_prompt_miss_is_computed_exactly_once(synthetic, tokens, threshold, frac, slots, seed):
    """Each missed expert of a prompt chunk goes over the link or to the CPU, never both, never neither; a
    short chunk as many to the CPU as the decode's split would send, a long one none; rows bit-identical to
    the reference's."""
    weights, spec, reference = synthetic
    backend = build_expert_backend(weights, spec, Placement.stages([(0, range(spec.n_layers))]),
                                   {0: DeviceSlot(0, CPU)}, StrataSettings(expert_cache=slots, pcie_frac=frac),
                                   {CPU: 0})
    rows = backend.rows_for(0, "prompt")
    rows.share.follow(threshold, backend.rows_for(0, "decode").share)
    sides: list[tuple[str, list[int]]] = []
    run, submit = rows.ring.run, rows.share.submit
    rows.ring.run = lambda layer, experts, consume: sides.append(("link", list(experts))) or run(layer, experts,
                                                                                                  consume)
    rows.share.submit = lambda layer, experts, *args: sides.append(("cpu", list(experts))) or submit(layer, experts,
                                                                                                      *args)
    twin = MissSplit(frac)  # the decode's split, taken in step
    gen = torch.Generator().manual_seed(seed)
    for layer in spec.moe_layers:
        hidden = torch.randn(tokens, spec.hidden_size, generator=gen)  # [T, H]
        ids = torch.rand(tokens, spec.n_experts, generator=gen).topk(spec.n_experts_used).indices  # [T, k]
        sides.clear()
        assert torch.equal(rows.rows(layer, hidden, ids), reference.rows(layer, hidden, ids))
        missed = sorted(e for e in set(ids.flatten().tolist()) if backend.tables[0].host[layer, e] < 0)
        link = [e for side, experts in sides if side == "link" for e in experts]
        cpu = [e for side, experts in sides if side == "cpu" for e in experts]
        assert sorted(link + cpu) == missed
        assert len(link) == (twin.take(len(missed)) if tokens <= threshold else len(missed))


# --- on a GPU ----------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_gpu_measures_its_threshold_at_load(tiny, caplog, monkeypatch):
    """Under ``auto`` with a split (forced whatever this host's CPU), a one-token chunk always splits
    (``test_under_auto_a_one_token_chunk_always_splits``); the decision is logged."""
    monkeypatch.setattr(split_auto, "MIN_CPU_SHARE", 0.0)
    with caplog.at_level(logging.INFO):
        engine = Engine.load(tiny, devices=["cuda:0"], max_context=64, expert_cache=4, arena="pinned",
                             pcie_frac="auto")
    assert engine.experts.cpu_prompt_tokens >= 1
    assert engine.experts.rows_for(0, "prompt").share.cpu_prompt_tokens == engine.experts.cpu_prompt_tokens
    assert f"cpu prompt tokens on cuda:0: {engine.experts.cpu_prompt_tokens} (" in caplog.text
    assert Engine.load(tiny, devices=["cuda:0"], max_context=64, expert_cache=4, arena="pinned",
                       pcie_frac=1.0).experts.cpu_prompt_tokens == 0


@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
@cuda
@pytest.mark.parametrize("slots", [0, 7])
def test_a_short_prompt_on_a_gpu_splits_and_matches_the_cpu(tiny_model_factory, monkeypatch, slots):
    """A GPU whose probe chose 8 tokens (forced): an 8-token prompt computes misses on the CPU, a 9-token one
    takes the grouped prefill; float32 logits within 1e-4 of the CPU device's, greedy text the same."""
    monkeypatch.setattr(expert_backend, "decide_cpu_prompt_tokens", lambda *args: 8)
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    options = dict(max_context=128, dtype="float32", expert_cache=slots, arena="pinned")
    cpu = Engine.load(path, devices=["cpu"], **options)
    gpu = Engine.load(path, devices=["cuda:0"], pcie_frac=0.5, **options)
    assert gpu.experts.rows_for(0, "prompt").share.cpu_prompt_tokens == 8
    for n, splits in ((8, True), (9, False)):
        ids = list(range(5, 5 + n))
        gpu.telemetry.reset()
        got = gpu.prefill(gpu.new_session(), ids, all_logits=True).cpu()
        assert (gpu.telemetry.snapshot()["experts_cpu"] > 0) == splits
        want = cpu.prefill(cpu.new_session(), ids, all_logits=True)
        assert (got - want).abs().max().item() <= 1e-4
        assert gpu.generate(ids, max_tokens=12, temperature=0) == cpu.generate(ids, max_tokens=12, temperature=0)
