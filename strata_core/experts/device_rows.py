"""``CachedExpertRows``: the ``ExpertRows`` of one device slot in one phase, reading each expert
from the first source of its layer's chain that holds it (the placement's expert sources).

For one MoE layer the routed (token, k) pairs are grouped by expert exactly as the reference
``DequantExpertRows`` groups them, and every group goes through the same ``expert_ffn`` on the same
bytes, whichever source holds them:

* resident: the device's cache slot;
* a peer's cache: its slot's bytes read across (the peer link) and computed here, or (``computed``)
  the inputs sent over and the rows computed on the peer;
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
from dataclasses import dataclass

import torch

from strata_core.devices import device_scope
from strata_core.experts.cache import ExpertCache
from strata_core.experts.gather import GATHER_COUNTS, fused_rows, gather_counts, pair_ffn
from strata_core.experts.grouped import GROUP_EXPERTS, dequantize_experts, expert_groups, grouped_ffn
from strata_core.experts.profile import UsageCounter
from strata_core.experts.rows import combine_rows, expert_ffn, group_by_expert
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import StagingRing
from strata_core.ops.gather import gather_experts

__all__ = ["CachedExpertRows", "Chain", "MissSplit"]


@dataclass(frozen=True)
class Chain:
    """One layer's expert sources resolved: the own cache, peers' caches (in chain order) with
    ``computed`` naming those whose rows are computed on the peer (the rest are read across), and
    whether misses may go over the host link and to the CPU (both: decode splits by ``--pcie-frac``)."""

    own: ExpertCache | None
    peers: tuple[ExpertCache, ...] = ()
    computed: frozenset[int] = frozenset()  # id() of the peers computing their own rows
    link: bool = True
    cpu: bool = True

    def caches(self) -> tuple[ExpertCache, ...]:
        """Every cache the layer reads, the own one first, then the peers in chain order."""
        return ((self.own,) if self.own is not None else ()) + self.peers

    def computes(self, cache: ExpertCache) -> bool:
        """Whether ``cache``'s rows are computed on its own device (activations go over)."""
        return id(cache) in self.computed

    def holders(self, layer: int, experts: list[int]) -> list[tuple[ExpertCache, int] | None]:
        """Per expert of ``layer``, (cache, slot) of the first cache of the chain holding it visibly,
        or None (a miss); one read of each cache's host table row."""
        found: list[tuple[ExpertCache, int] | None] = [None] * len(experts)
        for cache in self.caches():
            for i, slot in enumerate(cache.table.host[layer, experts].tolist()):
                if found[i] is None and slot >= 0:
                    found[i] = (cache, slot)
        return found

    def wait(self, layer: int, device: torch.device) -> None:
        """Make ``device``'s stream wait for swaps into ``layer`` still landing in any of the caches."""
        for cache in self.caches():
            cache.wait_layer(layer, device)


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
    """Expert rows on ``ring``'s device: each layer's ``chains[layer]`` says where experts are found."""

    def __init__(self, chains: dict[int, Chain], ring: StagingRing, usage: UsageCounter, telemetry: ExpertTelemetry,
                 split: MissSplit, cpu_pool: Executor | None = None, name: str = ""):
        self.chains, self.ring, self.usage, self.telemetry, self.split = chains, ring, usage, telemetry, split
        self.arena = ring.copier.arena
        self.device = ring.copier.device
        self.name = name or str(self.device)
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
        chain = self.chains[layer]
        if self.gather and self.decoding and chain.own is not None and not chain.peers:
            return self._gathered(layer, hidden, expert_ids, chain.own)
        T, k = expert_ids.shape
        fmt = self.arena.formats[layer]
        if chain.own is not None:
            self.telemetry.add_routing(expert_ids.numel(), (chain.own.table.mirror[layer][expert_ids] >= 0).sum())
        else:
            self.telemetry.routed += expert_ids.numel()
        order, experts, counts = group_by_expert(expert_ids)
        if self.grouped and not self.decoding and chain.link and not chain.computed:
            return self._grouped(layer, hidden, k, order, experts, counts, chain).view(T, k, -1)
        out = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
        ends = counts.cumsum(0).tolist()  # the host read of this layer
        groups = {e: (end - n, end) for e, n, end in zip(experts.tolist(), counts.tolist(), ends)}
        found = dict(zip(groups, chain.holders(layer, list(groups))))
        resident = [(e, where) for e, where in found.items() if where is not None]
        missed = [e for e, where in found.items() if where is None]

        def run(expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
            start, end = groups[expert]
            pairs = order[start:end]  # [n]
            x = hidden[pairs // k].to(gate.device)  # [n, H] (over to a peer computing its rows)
            with device_scope(gate.device):
                rows = expert_ffn(x, gate, up, down, fmt.qtypes, fmt.shapes)
            out[pairs] = rows.to(self.device, out.dtype)

        n_link = self._link_share(len(missed), chain)
        on_cpu = self._submit_cpu(layer, missed[n_link:], groups, order, k, hidden)
        chain.wait(layer, self.device)
        with self.telemetry.compute(self.device):
            for expert, (cache, slot) in resident:  # a peer's bytes come across, or its rows come back
                parts = cache.parts(layer, slot)
                run(expert, *(parts if chain.computes(cache) else (p.to(self.device) for p in parts)))
            self.ring.run(layer, missed[:n_link], lambda e, packed: run(e, *fmt.split(packed)))
        for pairs, rows in on_cpu:
            out[pairs] = rows.result().to(self.device, out.dtype)
        n_peer = sum(1 for _, (cache, _) in resident if cache is not chain.own)
        self.telemetry.count(self.name, {"resident": len(resident) - n_peer, "peer": n_peer,
                                         "pcie" if self.decoding else "streamed": n_link,
                                         "cpu": len(missed) - n_link})
        return out.view(T, k, -1)

    def _link_share(self, n_missed: int, chain: Chain) -> int:
        """How many of a layer's misses go over the host link (the rest to the CPU)."""
        if not chain.cpu:
            return n_missed
        if not chain.link:
            return 0
        return self.split.take(n_missed) if self.decoding else n_missed

    def _grouped(self, layer: int, hidden: torch.Tensor, k: int, order: torch.Tensor, experts: torch.Tensor,
                 counts: torch.Tensor, chain: Chain) -> torch.Tensor:
        """``[T*k, H]`` rows of a prefill chunk through the grouped prefill (``order``/``experts``/``counts``
        from ``group_by_expert``); the host reads the routing once, nothing waits per expert."""
        fmt, own = self.arena.formats[layer], chain.own
        ids, sizes = torch.stack([experts.long(), counts]).tolist()  # the host read of this layer
        holder = chain.holders(layer, ids)  # first cache holding each distinct expert
        slot = own.table.mirror[layer][experts] if own is not None else None  # [n] own slots on the device
        groups = expert_groups(sizes, self.group_experts)
        misses = [[(i - g.first, ids[i]) for i in range(g.first, g.last) if holder[i] is None] for g in groups]
        from_peers = [[(i - g.first, *holder[i]) for i in range(g.first, g.last)
                       if holder[i] is not None and holder[i][0] is not own] for g in groups]
        if self._group_ring is None or self._group_ring.buffers.shape[1] < self.group_experts:
            self._group_ring = StagingRing(self.ring.copier, rows=self.group_experts)
        out = hidden.new_empty(order.numel(), hidden.shape[-1])  # [T*k, H]

        def consume(j: int, staged: torch.Tensor) -> None:  # staged [R, B]: group j's misses in their rows
            g = groups[j]
            packed = staged[:g.last - g.first]  # [g, B]
            if slot is not None and len(misses[j]) + len(from_peers[j]) < g.last - g.first:
                group_slot = slot[g.first:g.last]  # [g]: one index_select from the own slots
                hit = own.slots.index_select(0, group_slot.clamp(min=0))  # [g, B]
                packed = torch.where((group_slot < 0)[:, None], packed, hit)
            for row, cache, slot_id in from_peers[j]:  # read across the peer link
                packed[row] = cache.slots[slot_id].to(self.device, non_blocking=True)
            weights = dequantize_experts(packed, fmt, hidden.dtype)
            pairs = order[g.start:g.end]  # [n_g]
            out[pairs] = grouped_ffn(hidden[pairs // k], *weights, counts[g.first:g.last],
                                     max(sizes[g.first:g.last]))

        chain.wait(layer, self.device)
        with self.telemetry.compute(self.device):
            self._group_ring.run_batches(layer, misses, consume)
        n_missed, n_peer = sum(map(len, misses)), sum(map(len, from_peers))
        self.telemetry.count(self.name, {"resident": len(ids) - n_missed - n_peer, "peer": n_peer,
                                         "streamed": n_missed})
        return out

    def _gathered(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                  cache: ExpertCache) -> torch.Tensor:
        """``[T, k, H]`` through the decode gather from ``cache`` and the pinned arena: a fixed
        sequence of device ops, no host read."""
        T, k = expert_ids.shape
        fmt, resident = self.arena.formats[layer], cache.table.mirror[layer]  # resident [E]
        expert = expert_ids.reshape(-1)  # [P], P = T*k
        slot = resident[expert]  # [P], -1 = miss
        self.telemetry.routed += T * k
        self.telemetry.add_counts(GATHER_COUNTS, gather_counts(slot, expert, resident, fmt.total))
        cache.wait_layer(layer, self.device)
        if self.device.type == "cuda":  # one fused op: misses staged, FFN straight from the quantized blocks
            with self.telemetry.compute(self.device):
                rows = fused_rows(hidden, cache.slots, self.arena.layer_buffer(layer), slot, expert, fmt)
            return rows.view(T, k, -1)
        with self.telemetry.timed("copy", self.device):
            packed = gather_experts(cache.slots, self.arena.layer_buffer(layer), slot, expert,
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
