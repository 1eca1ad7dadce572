"""Device expert cache on the CPU: rows bit-identical to the reference whatever the residency,
plus sizing, fill order, the pcie-frac split, adaptation and budget errors."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.config import StrataSettings
from strata_core.errors import BudgetError
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.profile import UsageProfile
from strata_core.experts.rows import DequantExpertRows
from strata_core.experts.sizing import GIB, cache_slots
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.tools.synthetic import Preset, write_synthetic
from strata_core.plugin.placement import DeviceSlot, Placement

CPU = torch.device("cpu")
PRESET = Preset(n_layers=2, n_experts=8, n_experts_used=2, hidden=64, expert_ffn=32, n_heads=4,
                n_kv_heads=2, head_dim=16, vocab=320, context=512)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("experts") / "tiny.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, dense_type=Q.Q8_0, progress=False)
    gguf_file = GGUFFile.open(path)
    spec = load_model_spec(gguf_file)
    weights = ExpertWeights(gguf_file, spec)
    return weights, spec, DequantExpertRows(weights)


def _plan(spec):
    return Placement.stages([(0, range(spec.n_layers))])


def _backend(model, **options):
    weights, spec, _ = model
    return build_expert_backend(weights, spec, _plan(spec), {0: DeviceSlot(0, CPU)}, StrataSettings(**options), {CPU: 0})


def _routing(spec, T, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, spec.hidden_size, generator=gen)  # [T, H]
    scores = torch.rand(T, spec.n_experts, generator=gen)  # [T, E]
    if skew:
        scores[:, :3] += 1.0  # experts 0..2 win every token
    ids = scores.topk(spec.n_experts_used).indices  # [T, k]
    return hidden, ids, torch.rand(T, spec.n_experts_used, generator=gen)


@settings(max_examples=25, deadline=None)
@given(slots=st.integers(0, 16), frac=st.sampled_from([0.0, 0.35, 1.0]), adapt=st.integers(0, 3),
       arena=st.sampled_from(["mmap", "pinned"]), pin_gib=st.sampled_from([None, 0.0001]),
       chunks=st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=4))
def test_rows_bit_identical_for_any_residency(model, slots, frac, adapt, arena, pin_gib, chunks):
    """Any cache size, pcie split, adaptation, arena kind and chunking gives the reference's bits."""
    _, spec, reference = model
    backend = _backend(model, expert_cache=slots, pcie_frac=frac, adapt_swaps=adapt, arena=arena,
                       pin_limit_gib=pin_gib)
    rows = backend.rows_for(0)
    for i, (T, decode) in enumerate(chunks):
        if decode:
            backend.begin_window()
        for layer in range(spec.n_layers):
            hidden, ids, weights = _routing(spec, T, seed=100 * i + layer, skew=True)
            assert torch.equal(rows(layer, hidden, ids, weights), reference(layer, hidden, ids, weights))
        if decode:
            backend.end_window()
        backend.tables[0].check()
    snap = backend.telemetry.snapshot()
    assert snap["expert_hits"] + snap["expert_misses"] == sum(T for T, _ in chunks) * spec.n_layers * 2
    backend.close()


def test_cache_sizes_and_log(model, caplog):
    _, spec, _ = model
    caplog.set_level("INFO")
    assert _backend(model, expert_cache=0).tables[0].n_resident == 0
    assert _backend(model, expert_cache=5).tables[0].n_resident == 5
    assert _backend(model, expert_cache=10_000).tables[0].n_resident == 16  # capped at every expert
    assert _backend(model).tables[0].n_resident == 16  # auto: host RAM holds them all
    assert "16 of 16 experts resident" in caplog.text


def test_default_fill_order_and_profile_order(model, tmp_path):
    table = _backend(model, expert_cache=3).tables[0]
    assert table.resident() == [(0, 0), (0, 1), (1, 0)]  # round-robin: (0,0), (1,0), (0,1)
    counts = torch.zeros(2, 8, dtype=torch.int64)
    counts[1, 7], counts[0, 4] = 9, 3
    UsageProfile(counts).save(tmp_path / "p.json")
    ranked = _backend(model, expert_cache=2, expert_profile=tmp_path / "p.json").tables[0]
    assert ranked.resident() == [(0, 4), (1, 7)]
    # auto sizing with a profile holds only the routed experts, unless fill-all
    assert _backend(model, expert_profile=tmp_path / "p.json").tables[0].n_resident == 2
    assert _backend(model, expert_profile=tmp_path / "p.json",
                    expert_cache_fill_all=True).tables[0].n_resident == 16


def test_pcie_frac_splits_decode_misses(model):
    _, spec, _ = model
    for frac, want_cpu in ((0.0, True), (1.0, False)):
        backend = _backend(model, expert_cache=0, pcie_frac=frac)
        backend.begin_window()
        backend.rows_for(0)(0, *_routing(spec, 4, seed=1))
        backend.end_window()
        snap = backend.telemetry.snapshot()
        assert (snap["experts_cpu"] > 0) == want_cpu and (snap["experts_pcie"] > 0) != want_cpu
        assert snap["experts_streamed"] == 0
    backend = _backend(model, expert_cache=0, pcie_frac=0.5)
    backend.begin_window()
    for seed in range(6):
        backend.rows_for(0)(seed % 2, *_routing(spec, 1, seed=seed))
    snap = backend.telemetry.snapshot()
    assert snap["experts_pcie"] == snap["experts_cpu"] == 6  # 12 misses, split evenly


def test_prefill_misses_stream_and_count_bytes(model):
    _, spec, _ = model
    backend = _backend(model, expert_cache=0)
    backend.rows_for(0)(0, *_routing(spec, 16, seed=3))
    snap = backend.telemetry.snapshot()
    assert snap["experts_streamed"] > 0 and snap["expert_hits"] == 0 and snap["hit_rate"] == 0.0
    assert snap["bytes_streamed"] == snap["experts_streamed"] * backend.arena.formats[0].total


def test_adaptation_swaps_in_hot_experts(model):
    _, spec, _ = model
    backend = _backend(model, expert_cache=2, adapt_swaps=2)  # default fill: (0,0), (1,0)
    rows = backend.rows_for(0)
    for seed in range(3):
        backend.begin_window()
        for layer in range(2):
            hidden, ids, w = _routing(spec, 1, seed=seed, skew=True)
            rows(layer, hidden, torch.tensor([[1, 2]]), w)  # experts 1 and 2 are hot
        backend.end_window()
    table = backend.tables[0]
    assert {e for _, e in table.resident()} <= {1, 2} and table.n_resident == 2
    assert backend.telemetry.snapshot()["swaps"] >= 2
    table.check()


def test_budget_errors_name_need_and_have(model):
    _, spec, _ = model
    weights = model[0]
    with pytest.raises(BudgetError, match=r"dense part needs .* GiB .* only .* GiB is available"):
        build_expert_backend(weights, spec, _plan(spec), {0: DeviceSlot(0, CPU)}, StrataSettings(), {CPU: 1 << 50})
    with pytest.raises(BudgetError, match="--expert-cache-gib 100000"):
        build_expert_backend(weights, spec, _plan(spec), {0: DeviceSlot(0, CPU)}, StrataSettings(expert_cache_gib=100000), {CPU: 0})


def test_a_vram_budget_holds_the_dense_part_and_the_cache_together(model):
    """``--vram-budget-gib``: the cache gets what the budget leaves after the dense part and the reserve
    (host RAM holds every expert without it); a dense part beyond the budget is an error naming it."""
    weights, spec, _ = model
    slot_bytes = _backend(model, expert_cache=0).arena.slot_bytes
    dense, reserve = 10_000, 1 << 20
    budget = dense + reserve + 5 * slot_bytes + slot_bytes // 2  # room for five experts and a half
    settings = StrataSettings(vram_budget_gib=budget / GIB, reserve_mib=1)
    backend = build_expert_backend(weights, spec, _plan(spec), {0: DeviceSlot(0, CPU)}, settings, {CPU: dense})
    assert backend.tables[0].n_resident == 5
    with pytest.raises(BudgetError, match=r"only .* GiB is available within --vram-budget-gib"):
        build_expert_backend(weights, spec, _plan(spec), {0: DeviceSlot(0, CPU)}, settings, {CPU: budget})


def test_cache_slots_precedence():
    s = StrataSettings(expert_cache=7)
    assert cache_slots(s, CPU, 100, n_candidates=5, n_ranked=None, left_bytes=0) == 5
    s = StrataSettings(expert_cache_gib=1)
    assert cache_slots(s, CPU, GIB // 4, n_candidates=50, n_ranked=None, left_bytes=GIB) == 4
    s = StrataSettings()
    assert cache_slots(s, CPU, 10, n_candidates=50, n_ranked=3, left_bytes=1000) == 3
    assert cache_slots(s, CPU, 10, n_candidates=50, n_ranked=None, left_bytes=205) == 20
