"""The grouped prefill (experts/grouped.py) on the CPU: its pieces and the whole path, forced on, agree
with the reference ``expert_ffn`` within float tolerance, with the same telemetry as the loop per expert."""

from __future__ import annotations

import random

import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.grouped import dequantize_experts, expert_groups, grouped_ffn, padded_index
from strata_core.experts.rows import expert_ffn
from strata_core.plugin.placement import DeviceSlot, Placement

CPU = torch.device("cpu")
PROMPT = list(range(7, 40))

pytestmark = pytest.mark.usefixtures("one_thread")


def _backend(synthetic, **options):
    weights, spec, _ = synthetic
    placement = Placement.stages([(0, range(spec.n_layers))])
    return build_expert_backend(weights, spec, placement, {0: DeviceSlot(0, CPU)}, StrataSettings(**options), {CPU: 0})


@pytest.mark.parametrize("limit", [1, 3, 32])
def test_expert_groups_cover_every_expert_and_pair_in_order(limit):
    counts = [5, 1, 7, 2, 2, 9, 1]
    groups = expert_groups(counts, limit)
    assert [g.first for g in groups] == list(range(0, len(counts), limit))
    assert all(0 < g.last - g.first <= limit for g in groups)
    assert groups[-1].last == len(counts) and groups[-1].end == sum(counts)
    for g, nxt in zip(groups, groups[1:]):
        assert (g.last, g.end) == (nxt.first, nxt.start)
    assert all(g.end - g.start == sum(counts[g.first:g.last]) for g in groups)
    assert expert_groups([], limit) == []


def test_padded_index_puts_each_experts_pairs_at_the_start_of_its_row_block():
    counts = torch.tensor([2, 1, 3])
    assert padded_index(counts, 3, 6).tolist() == [0, 1, 3, 6, 7, 8]
    assert padded_index(counts, 4, 6).tolist() == [0, 1, 4, 8, 9, 10]


def _kernels() -> list[tuple[bool, torch.dtype]]:
    """``grouped_ffn`` kernels and dtypes to test on the CPU: the padded bmm in float32 and bf16, and
    ``torch._grouped_mm`` (bf16 only) when this torch runs it on the CPU."""
    cases = [(False, torch.float32), (False, torch.bfloat16)]
    try:
        torch._grouped_mm(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([1, 4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return cases
    return [*cases, (True, torch.bfloat16)]


@pytest.mark.parametrize(("grouped_mm", "dtype"), _kernels())
def test_grouped_ffn_matches_expert_ffn_per_expert(synthetic, grouped_mm, dtype):
    weights, spec, _ = synthetic
    arena = _backend(synthetic).arena
    fmt = arena.formats[0]
    experts, counts = [3, 0, 9, 15], [4, 1, 17, 6]
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, e)]) for e in experts])  # [G, total]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), spec.hidden_size, generator=gen).to(dtype)  # [n, H] sorted by expert
    got = grouped_ffn(x, *dequantize_experts(packed, fmt, dtype), torch.tensor(counts), max(counts),
                      grouped_mm=grouped_mm)
    want = torch.cat([expert_ffn(xs, *arena.parts(0, e), fmt.qtypes, fmt.shapes)
                      for e, xs in zip(experts, x.split(counts))])  # [n, H]
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("arena", ["mmap", "pinned"])
@pytest.mark.parametrize("slots,limit", [(0, 32), (9, 3), (32, 2), (20, 1)])
def test_grouped_rows_and_telemetry_match_the_loop_per_expert(synthetic, arena, slots, limit):
    """Random cache contents and routings: the grouped rows are the reference's within float32
    tolerance, and every counter is the loop's."""
    _, spec, reference = synthetic
    runs = {}
    for grouped in (False, True):
        backend = _backend(synthetic, expert_cache=slots, arena=arena)
        cache = backend.caches[0]
        for entry in cache.table.resident():
            cache.table.evict(*entry)
        everything = [(l, e) for l in range(spec.n_layers) for e in range(spec.n_experts)]
        cache.fill(random.Random(slots).sample(everything, len(everything)))
        backend.use_grouped_prefill(grouped)
        rows = backend.rows_for(0)
        rows.group_experts = limit
        backend.telemetry.reset()
        gen = torch.Generator().manual_seed(slots)
        for T in (1, 5, 40):
            for layer in range(spec.n_layers):
                hidden = torch.randn(T, spec.hidden_size, generator=gen)  # [T, H]
                ids = torch.rand(T, spec.n_experts, generator=gen).topk(spec.n_experts_used).indices  # [T, k]
                got, want = rows.rows(layer, hidden, ids), reference.rows(layer, hidden, ids)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        runs[grouped] = {k: v for k, v in backend.telemetry.snapshot().items()
                         if k not in ("copy_s", "compute_s", "link_gbps")}
    assert runs[True] == runs[False]


def test_grouped_prefill_logits_and_greedy_output_match_the_cpu_reference(tiny_model_factory):
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    reference = Engine.load(path, max_context=96, expert_cache=7)
    grouped = Engine.load(path, max_context=96, expert_cache=7)
    grouped.experts.use_grouped_prefill(True)
    logits = [engine.prefill(engine.new_session(), PROMPT, all_logits=True) for engine in (reference, grouped)]
    assert torch.allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert grouped.generate(PROMPT, max_tokens=8, temperature=0) == reference.generate(PROMPT, max_tokens=8,
                                                                                        temperature=0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("arena", ["mmap", "pinned"])
@pytest.mark.parametrize("slots", [0, 7, 24])
def test_cuda_prefill_matches_the_cpu(tiny_model_factory, slots, arena):
    """On CUDA the grouped prefill is chosen by itself; float32 logits within 1e-4 of the CPU's."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    ids = list(range(5, 60))
    options = dict(max_context=128, dtype="float32", expert_cache=slots, arena=arena)
    cpu, gpu = Engine.load(path, devices=["cpu"], **options), Engine.load(path, devices=["cuda:0"], **options)
    assert gpu.experts.rows_for(0).grouped and not cpu.experts.rows_for(0).grouped
    want = cpu.prefill(cpu.new_session(), ids, all_logits=True)
    got = gpu.prefill(gpu.new_session(), ids, all_logits=True).cpu()
    print(f"cuda grouped prefill, {slots} slots, {arena}: max |diff| {(got - want).abs().max().item():.3g}")
    assert (got - want).abs().max().item() <= 1e-4
    assert gpu.generate(ids, max_tokens=12, temperature=0) == cpu.generate(ids, max_tokens=12, temperature=0)


@cuda
def test_cuda_grouped_mm_matches_the_padded_bmm(synthetic):
    """bf16 on CUDA: ``torch._grouped_mm`` (chosen by itself on Hopper) gives the padded bmm's rows."""
    _, spec, _ = synthetic
    arena = _backend(synthetic).arena
    fmt, dev = arena.formats[0], torch.device("cuda:0")
    experts, counts = [3, 0, 9, 15], [4, 1, 17, 6]
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, e)]) for e in experts]).to(dev)
    x = torch.randn(sum(counts), spec.hidden_size, device=dev).bfloat16()  # [n, H]
    weights = dequantize_experts(packed, fmt, torch.bfloat16)
    count = torch.tensor(counts, device=dev)
    got, want = (grouped_ffn(x, *weights, count, max(counts), grouped_mm=mm) for mm in (None, False))
    print(f"grouped_mm vs bmm (bf16): max |diff| {(got - want).abs().max().item():.3g}, "
          f"max |rows| {want.abs().max().item():.3g}")
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())

