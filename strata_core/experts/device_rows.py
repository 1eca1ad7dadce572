"""``CachedExpertRows``: the ``ExpertRows`` of one device, reading each expert from wherever it is.

For one MoE layer the routed (token, k) pairs are grouped by expert exactly as the reference
``DequantExpertRows`` groups them, and every group goes through the same ``expert_ffn`` on the same
bytes, whichever source holds them:

* resident: the device's cache slot;
* prefill miss: streamed from the arena through the double-buffered ``StagingRing``;
* decode miss: a ``--pcie-frac`` share read over the host link (the ring again), the rest computed
  on the CPU from the arena (on a worker thread when the device is a GPU).

``combine_rows`` then sums the rows in one fixed order, so the output is bit-identical to the
reference for any cache content, split and chunking. The host reads the layer's distinct experts
once per layer (``group_by_expert``); nothing waits on the host per expert.

With ``gather`` set (the backend sets it on CUDA when every arena layer is pinned and
``--pcie-frac`` is 1; tests force it on the CPU), a decode window takes the decode gather instead
(gather.py): the routed pairs' experts are found from the device mirror of the residency table,
read from the slots or zero-copy from the pinned arena, and computed per pair, so the host never
reads the routing and nothing synchronises per layer.

With ``grouped`` set (the default on CUDA; tests force it on the CPU), a prefill chunk takes the
grouped prefill instead of the loop per expert (grouped.py): per group of at most ``group_experts``
experts, one index_select from the slots, the misses through the staging ring, one ``dequantize``
per matrix and grouped products. Its rows agree with the reference within float tolerance, not
bit for bit, which is why the CPU (the bit-exact reference) keeps the loop.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import torch

from strata_core.experts.cache import ExpertCache
from strata_core.experts.gather import GATHER_COUNTS, fused_rows, gather_counts, pair_ffn
from strata_core.experts.grouped import GROUP_EXPERTS, dequantize_experts, expert_groups, grouped_ffn
from strata_core.experts.profile import UsageCounter
from strata_core.experts.rows import combine_rows, expert_ffn, group_by_expert
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import StagingRing
from strata_core.ops.gather import gather_experts

__all__ = ["CachedExpertRows", "MissSplit"]


class MissSplit:
    """Deterministic ``--pcie-frac`` split of decode misses: a running credit, so the share holds
    across layers even with one miss per layer. ``take(n)`` = how many of ``n`` misses use the link."""

    def __init__(self, frac: float):
        self.frac, self.credit = frac, 0.0

    def take(self, n: int) -> int:
        self.credit += n * self.frac
        link = min(n, int(self.credit + 1e-9))
        self.credit -= link
        return link


class CachedExpertRows:
    """Expert rows on ``cache.device``: slots for resident experts, the arena for misses."""

    def __init__(self, cache: ExpertCache, ring: StagingRing, usage: UsageCounter, telemetry: ExpertTelemetry,
                 split: MissSplit, cpu_pool: Executor | None = None):
        self.cache, self.ring, self.usage, self.telemetry, self.split = cache, ring, usage, telemetry, split
        self.arena = cache.arena
        self.device = cache.device
        self.cpu_pool = cpu_pool
        self.decoding = False  # set by the backend inside a decode window
        self.gather = False  # decode windows take the decode gather (set by the backend)
        self.grouped = self.device.type == "cuda"  # prefill chunks take the grouped prefill
        self.group_experts = GROUP_EXPERTS
        self._group_ring: StagingRing | None = None

    def __call__(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        return combine_rows(self.rows(layer, hidden, expert_ids), weights)  # [T, H]

    def rows(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``[T, k, H]``: row (t, j) is expert ``expert_ids[t, j]`` applied to token t."""
        self.usage.add(layer, expert_ids)
        if self.gather and self.decoding:
            return self._gathered(layer, hidden, expert_ids)
        T, k = expert_ids.shape
        table, fmt = self.cache.table, self.arena.formats[layer]
        self.telemetry.add_routing(expert_ids.numel(), (table.mirror[layer][expert_ids] >= 0).sum())
        order, experts, counts = group_by_expert(expert_ids)
        if self.grouped and not self.decoding:
            return self._grouped(layer, hidden, k, order, experts, counts).view(T, k, -1)
        out = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
        ends = counts.cumsum(0).tolist()  # the host read of this layer
        groups = {e: (end - n, end) for e, n, end in zip(experts.tolist(), counts.tolist(), ends)}
        slots = table.host[layer, experts.cpu()].tolist()
        resident = [(e, s) for e, s in zip(groups, slots) if s >= 0]
        missed = [e for e, s in zip(groups, slots) if s < 0]

        def run(expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
            start, end = groups[expert]
            pairs = order[start:end]  # [n]
            x = hidden[pairs // k]  # [n, H]
            out[pairs] = expert_ffn(x, gate, up, down, fmt.qtypes, fmt.shapes).to(out.dtype)

        n_link = self.split.take(len(missed)) if self.decoding else len(missed)
        on_cpu = self._submit_cpu(layer, missed[n_link:], groups, order, k, hidden)
        self.cache.wait_layer(layer)
        with self.telemetry.compute(self.device):
            for expert, slot in resident:
                run(expert, *self.cache.parts(layer, slot))
            self.ring.run(layer, missed[:n_link], lambda e, packed: run(e, *fmt.split(packed)))
        for pairs, rows in on_cpu:
            out[pairs] = rows.result().to(self.device, out.dtype)
        self.telemetry.experts["resident"] += len(resident)
        self.telemetry.experts["pcie" if self.decoding else "streamed"] += n_link
        self.telemetry.experts["cpu"] += len(missed) - n_link
        return out.view(T, k, -1)

    def _grouped(self, layer: int, hidden: torch.Tensor, k: int, order: torch.Tensor, experts: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """``[T*k, H]`` rows of a prefill chunk through the grouped prefill (``order``/``experts``/``counts``
        from ``group_by_expert``); the host reads the routing once, nothing waits per expert."""
        fmt, cache = self.arena.formats[layer], self.cache
        ids, sizes = torch.stack([experts.long(), counts]).tolist()  # the host read of this layer
        on_host = cache.table.host[layer, ids].tolist()  # slot per distinct expert, -1 = miss
        slot = cache.table.mirror[layer][experts]  # [n] the same on the device
        groups = expert_groups(sizes, self.group_experts)
        misses = [[(i - g.first, ids[i]) for i in range(g.first, g.last) if on_host[i] < 0] for g in groups]
        if self._group_ring is None or self._group_ring.buffers.shape[1] < self.group_experts:
            self._group_ring = StagingRing(self.ring.copier, rows=self.group_experts)
        out = hidden.new_empty(order.numel(), hidden.shape[-1])  # [T*k, H]

        def consume(j: int, staged: torch.Tensor) -> None:  # staged [R, B]: group j's misses in their rows
            g = groups[j]
            packed, group_slot = staged[:g.last - g.first], slot[g.first:g.last]  # [g, B], [g]
            if len(misses[j]) < g.last - g.first:  # some resident: one index_select from the slots
                hit = cache.slots.index_select(0, group_slot.clamp(min=0))  # [g, B]
                packed = torch.where((group_slot < 0)[:, None], packed, hit) if misses[j] else hit
            weights = dequantize_experts(packed, fmt, hidden.dtype)
            pairs = order[g.start:g.end]  # [n_g]
            out[pairs] = grouped_ffn(hidden[pairs // k], *weights, counts[g.first:g.last],
                                     max(sizes[g.first:g.last]))

        cache.wait_layer(layer)
        with self.telemetry.compute(self.device):
            self._group_ring.run_batches(layer, misses, consume)
        n_missed = sum(map(len, misses))
        self.telemetry.experts["resident"] += len(ids) - n_missed
        self.telemetry.experts["streamed"] += n_missed
        return out

    def _gathered(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``[T, k, H]`` through the decode gather: a fixed sequence of device ops, no host read."""
        T, k = expert_ids.shape
        fmt, resident = self.arena.formats[layer], self.cache.table.mirror[layer]  # resident [E]
        expert = expert_ids.reshape(-1)  # [P], P = T*k
        slot = resident[expert]  # [P], -1 = miss
        self.telemetry.routed += T * k
        self.telemetry.add_counts(GATHER_COUNTS, gather_counts(slot, expert, resident, fmt.total))
        self.cache.wait_layer(layer)
        if self.device.type == "cuda":  # one fused op: misses staged, FFN straight from the quantized blocks
            with self.telemetry.compute(self.device):
                rows = fused_rows(hidden, self.cache.slots, self.arena.layer_buffer(layer), slot, expert, fmt)
            return rows.view(T, k, -1)
        with self.telemetry.timed("copy", self.device):
            packed = gather_experts(self.cache.slots, self.arena.layer_buffer(layer), slot, expert,
                                    fmt.total)  # [P, total]
        with self.telemetry.compute(self.device):
            x = hidden[:, None, :].expand(T, k, hidden.shape[-1]).reshape(T * k, -1)  # [P, H]
            rows = pair_ffn(x, packed, fmt)  # [P, H]
        return rows.view(T, k, -1)

    def _submit_cpu(self, layer: int, experts: list[int], groups: dict[int, tuple[int, int]],
                    order: torch.Tensor, k: int, hidden: torch.Tensor) -> list[tuple[torch.Tensor, Future]]:
        """Start the CPU rows of ``experts`` from the arena; returns (pairs, future rows) per expert."""
        fmt = self.arena.formats[layer]
        jobs = []
        for expert in experts:
            start, end = groups[expert]
            pairs = order[start:end]  # [n]
            x = hidden[pairs // k].cpu()  # [n, H]
            parts = self.arena.parts(layer, expert)
            if self.cpu_pool is None:
                fut: Future = Future()
                fut.set_result(expert_ffn(x, *parts, fmt.qtypes, fmt.shapes))
            else:
                fut = self.cpu_pool.submit(expert_ffn, x, *parts, fmt.qtypes, fmt.shapes)
            jobs.append((pairs, fut))
        return jobs
