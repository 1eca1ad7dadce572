"""The grouped prefill (experts/grouped.py) on the CPU: its pieces and the whole path, forced on, agree
with the reference ``expert_ffn`` within float tolerance, with the same telemetry as the loop per expert."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.grouped import dequantize_experts, expert_groups, fused_gate_up, grouped_ffn, padded_index
from strata_core.experts.rows import expert_ffn
from strata_core.experts import grouped_prefill
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import ArenaCopier, StagingRing, copy_runs
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


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=12, unique_by=lambda p: p[0])
       .map(sorted))
def test_copy_runs_cover_the_batch_in_order_with_the_fewest_copies(batch):
    runs = copy_runs(batch)
    assert [(row + i, expert + i) for row, expert, m in runs for i in range(m)] == batch
    for (row, expert, m), (row2, expert2, _) in zip(runs, runs[1:]):  # no two neighbours could be one copy
        assert (row + m, expert + m) != (row2, expert2)


def test_fused_gate_up_is_found_only_for_the_halves_of_one_tensor():
    both = torch.randn(3, 8, 4)  # [G, 2F, H]
    gate, up = both[:, :4], both[:, 4:]
    assert torch.equal(fused_gate_up(gate, up), both)
    assert fused_gate_up(gate.clone(), up.clone()) is None
    assert fused_gate_up(up, gate) is None


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


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped prefill's float product against the loop's: the CPU kernels' float bodies
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


def _spare_rows_cases() -> list[tuple[str, bool, torch.dtype]]:
    cases = [("cpu", mm, dtype) for mm, dtype in _kernels()]
    cuda = [("cuda", None, torch.bfloat16), ("cuda", False, torch.float32)] if torch.cuda.is_available() else []
    return cases + cuda


@pytest.mark.parametrize(("device", "grouped_mm", "dtype"), _spare_rows_cases())
@pytest.mark.parametrize("biased", [False, True])
def test_grouped_ffn_leaves_spare_rows_and_unrouted_experts_out(synthetic, device, grouped_mm, dtype, biased):
    """A planned group's buffer: more rows than pairs, experts with no pair, the largest count not given;
    its pairs' rows are those of the exact call (with biases, the spare rows index no bias out of range)."""
    _, spec, _ = synthetic
    arena = _backend(synthetic).arena
    fmt = arena.formats[0]
    experts, counts = [3, 0, 9, 15], [4, 0, 17, 0]
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, e)]) for e in experts]).to(device)
    gen = torch.Generator().manual_seed(1)
    n, F, H = sum(counts), fmt.shapes[0][0], spec.hidden_size
    x = torch.randn(n + 11, H, generator=gen).to(dtype).to(device)  # [n + spare, H]
    ffn = SILU if not biased else ExpertFFN(gate_bias=torch.randn(spec.n_experts, F, generator=gen).to(device),
                                             down_bias=torch.randn(spec.n_experts, H, generator=gen).to(device))
    weights = dequantize_experts(packed, fmt, dtype)
    ids, count = torch.tensor(experts, device=device), torch.tensor(counts, device=device)
    got = grouped_ffn(x, *weights, count, grouped_mm=grouped_mm, ffn=ffn, experts=ids)
    want = grouped_ffn(x[:n], *weights, count, max(counts), grouped_mm=grouped_mm, ffn=ffn, experts=ids)
    assert got.shape == (n + 11, H) and torch.equal(got[:n], want)


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped prefill's float product against the loop's: the CPU kernels' float bodies
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
                         if k not in ("copy_s", "compute_s", "link_gbps", "expert_gbps")}
    assert runs[True] == runs[False]


def test_a_prefetch_spares_the_copies_it_covers_and_only_those(synthetic):
    """``StagingRing.prefetch``: ``run_batches`` of the same layer copies only the batches no prefetched
    one covers (a subset is covered), an empty batch takes no buffer, and every consumed buffer holds
    the experts its batch names."""
    backend = _backend(synthetic, arena="pinned")
    arena = backend.arena
    copier = ArenaCopier(arena, CPU, ExpertTelemetry())
    ring = StagingRing(copier, rows=3)
    copied = []
    real = copier.copy_rows
    copier.copy_rows = lambda layer, batch, dst: copied.append((layer, list(batch))) or real(layer, batch, dst)
    packed = [torch.cat([p.reshape(-1) for p in arena.parts(1, e)]) for e in range(8)]

    def run(layer, batches):
        seen = []

        def consume(j, buffer):
            assert (buffer is None) == (not batches[j])
            seen.extend(torch.equal(buffer[row, :packed[e].numel()], packed[e]) for row, e in batches[j])
        ring.run_batches(layer, batches, consume)
        assert seen and all(seen)

    ring.prefetch(1, [[], [(0, 2), (1, 3)], [(0, 5)], [(0, 7)]])  # depth 2: the first two with experts
    assert copied == [(1, [(0, 2), (1, 3)]), (1, [(0, 5)])]
    copied.clear()
    run(1, [[], [(1, 3)], [(0, 6)], [], [(2, 4)]])  # covered, not covered, beyond the prefetch
    assert copied == [(1, [(0, 6)]), (1, [(2, 4)])]
    copied.clear()
    run(1, [[(1, 3)], [(0, 5)]])  # the buffers were used since: nothing is covered any more
    assert len(copied) == 2
    ring.prefetch(0, [[(0, 2)]])
    copied.clear()
    run(1, [[(0, 2)]])  # another layer's bytes
    assert copied == [(1, [(0, 2)])]


def test_the_ring_cycles_on_from_one_call_to_the_next(synthetic):
    """``StagingRing``: a call's batches take the buffers after the last call's, and a prefetch fills the
    ones the next call takes (so a call's first copies take the buffers read longest ago)."""
    arena = _backend(synthetic, arena="pinned").arena
    copier = ArenaCopier(arena, CPU, ExpertTelemetry())
    ring = StagingRing(copier, depth=3, rows=2)
    copied = []
    real = copier.copy_rows
    copier.copy_rows = lambda layer, batch, dst: copied.append(dst.data_ptr()) or real(layer, batch, dst)
    where = [buffer.data_ptr() for buffer in ring.buffers]

    def taken(layer, batches):
        used = []
        ring.run_batches(layer, batches,
                         lambda j, buffer: buffer is None or used.append(where.index(buffer.data_ptr())))
        return used

    assert taken(1, [[(0, 1)], [(0, 2)]]) == [0, 1]
    assert taken(0, [[(0, 3)], [], [(0, 4)]]) == [2, 0]  # an empty batch takes no buffer
    copied.clear()
    ring.prefetch(1, [[(0, 5)], [(0, 6)]])
    assert copied == [where[1], where[2]]
    assert taken(1, [[(0, 5)], [(0, 6)]]) == [1, 2] and len(copied) == 2  # the prefetched copies, not again


@pytest.mark.parametrize("strategy", ["single", "peer_tier"])
def test_prefetched_prompts_equal_unprefetched_ones_bit_for_bit(tiny_model_factory, monkeypatch, strategy):
    """A planned prefill (every expert taken as routed: the groups cut and enqueued before the routing is
    read, each layer's misses prefetched) gives the logits of the same prefill reading the routing
    first, bit for bit; the predictions are issued."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    options = {"max_context": 96, "expert_cache": 7} | (
        {"strategy": "peer_tier", "devices": ["cpu", "cpu"], "arena": "pinned",
         "strategy_options": {"peer_slots": 5, "peer_prefill_rows": -1, "peer_stream_frac": 0.5}}
        if strategy == "peer_tier" else {})
    prefetched = []
    real = StagingRing.prefetch
    monkeypatch.setattr(StagingRing, "prefetch", lambda ring, layer, batches: prefetched.append(layer)
                        or real(ring, layer, batches))
    logits = []
    for pairs in (10**9, 0):  # no prefetch, then always
        monkeypatch.setattr(grouped_prefill, "PREFETCH_PAIRS", pairs)
        engine = Engine.load(path, **options)
        engine.experts.use_grouped_prefill(True)
        logits.append(engine.prefill(engine.new_session(), PROMPT, all_logits=True))
    assert torch.equal(logits[0], logits[1])
    assert set(prefetched) == {1, 2}


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped prefill's float product against the loop's: the CPU kernels' float bodies
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


@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
@cuda
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("arena", ["mmap", "pinned"])
@pytest.mark.parametrize("slots", [0, 7, 24])
def test_cuda_prefill_matches_the_cpu(tiny_model_factory, monkeypatch, slots, arena, prefetch):
    """On CUDA the grouped prefill is chosen by itself; float32 logits within 1e-4 of the CPU's, also with
    every layer's misses prefetched (the copies on the copy stream, ordered by events only)."""
    monkeypatch.setattr(grouped_prefill, "PREFETCH_PAIRS", 0 if prefetch else grouped_prefill.PREFETCH_PAIRS)
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

