"""The grouped prefill of :class:`~strata_core.experts.device_rows.CachedExpertRows`: a prompt chunk's routed
pairs sorted by device and expert, each device's groups of experts computed at once (experts/grouped.py), a
computing peer's share enqueued on it first, the next layer's first groups of misses prefetched while its
attention runs. device_rows.py's module doc says when a chunk takes it and what it guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from strata_core.experts.chain import Chain
from strata_core.experts.ffn import ExpertFFN
from strata_core.experts.grouped import GroupPlan, grouped_rows
from strata_core.experts.prompt_plan import assign, group_plans, ranks
from strata_core.experts.transfer import StagingRing
from strata_core.runtime.devices import PendingRead

if TYPE_CHECKING:
    from strata_core.experts.cache import ExpertCache
    from strata_core.experts.peer import PeerLane

__all__ = ["PREFETCH_PAIRS", "GroupedPrefill"]

#: A prompt chunk with at least this many (token, k) pairs per expert is planned: every expert is taken as
#: routed (near certain from here on), so its groups are enqueued, and each layer's first groups of misses
#: streamed (``_prefetch``), before the routing is read.
PREFETCH_PAIRS = 16


class GroupedPrefill:
    """The grouped prefill of a device slot's prompt rows (a part of ``CachedExpertRows``, which holds the
    state it reads: chains, arena, planner, staging rings, telemetry)."""

    def _grouped(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, chain: Chain,
                 ffn: ExpertFFN) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows ``[T*k, H]``, ``order [T*k]``): row i is pair ``order[i]``'s, of a prefill chunk
        (``expert_ids [T, k]``) through the grouped prefill. The pairs are sorted by device, then by expert
        as ``assign`` orders them (prompt_plan.py), so each device's pairs are one span of ``order``. The experts a
        computing peer holds, and its share of the misses, go to that peer, enqueued first and waiting
        only for the routing, so both devices compute at once.

        A chunk of ``PREFETCH_PAIRS`` pairs an expert or more is *planned* (``PromptPlanner``): every expert is
        taken as routed, so the groups follow from the residency, and their spans of ``order`` stay on
        the device (ops/spans.py): the host reads the routing once, after every group and the next layer's
        prefetch are enqueued (only the peers' rows coming back wait for it), from a copy made as the
        routing was counted (``PendingRead``): it waits for the routing, not for the groups, so the host
        stays ahead of the device. A smaller chunk reads it first and leaves out the experts no pair routes
        to. A graphed pass (``live_pairs`` set) is planned whatever its size and reads nothing: its telemetry
        counts every expert as routed, as its planned groups compute them all."""
        counted = self._count_routing(layer, expert_ids, chain)  # [E]
        fmt, k, n_experts = self.arena.formats[layer], expert_ids.shape[1], self.arena.n_experts
        flat = expert_ids.reshape(-1)  # [T*k]
        per_expert, counts_read = None, None
        graphed = self.live_pairs is not None  # a graphed pass: planned, and nothing read on the host
        if graphed:
            per_expert = [1] * n_experts  # every expert taken as routed: what the planned groups compute
            counted = torch.zeros_like(counted).index_add_(0, flat, torch.ones_like(flat))  # the padding's pairs too
        elif flat.numel() >= PREFETCH_PAIRS * n_experts:
            counts_read = PendingRead(counted)  # read after the enqueues, waiting for the routing only
        if graphed or counts_read is not None:
            plan = self.planner.plan(layer, chain, self.group_experts)
            holder, owners, rank, plans = plan.holder, plan.owners, plan.rank, plan.plans
        else:
            holder = chain.holders(layer, list(range(n_experts)))  # first cache holding each expert
            per_expert = counted.tolist()  # the host read of this layer (a small chunk)
            owners = [[e for e in experts if per_expert[e]] for experts in assign(chain, holder)]
            rank = ranks(owners, n_experts, flat.device)
            plans = group_plans(chain, self.device, holder, owners, self.group_experts, per_expert)
        order = torch.argsort(rank[flat], stable=True)  # [T*k]: as ``owners``
        by_rank = torch.empty_like(counted).index_copy_(0, rank, counted)  # [E]: pairs per expert, by rank
        bounds = torch.cat((by_rank.new_zeros(1), by_rank.cumsum(0)))  # [E + 1]: each expert's span of ``order``
        out = hidden.new_empty(order.numel(), hidden.shape[-1])  # [T*k, H]
        firsts = [0]  # each device's first rank
        for experts in owners:
            firsts.append(firsts[-1] + len(experts))
        chain.wait(layer, self.device)
        lanes = [(d, lane, lane.mark()) for d, lane in enumerate(chain.lanes, 1) if owners[d]]
        away = [self._on_peer(lane, after, layer, hidden, k, order, bounds[firsts[d]:firsts[d + 1] + 1], plans[d], ffn)
                for d, lane, after in lanes]
        with self.telemetry.compute(self.device):  # the peers' work first: it waits only for the routing
            grouped_rows(layer, fmt, hidden, k, order, bounds[:firsts[1] + 1], plans[0], chain.own, self._staging(),
                         out, ffn)
        self._prefetch(layer + 1, order.numel(), hidden.shape[0])
        per_expert = per_expert if counts_read is None else counts_read.tolist()  # a planned layer's one host read
        ends = [0]
        for e in (e for experts in owners for e in experts):
            ends.append(ends[-1] + per_expert[e])
        for (d, lane, after), rows in zip(lanes, away):  # the peers' rows back, as many as were routed there
            start, end = ends[firsts[d]], ends[firsts[d + 1]]
            with lane.enqueue(after, again=True):
                out[start:end].copy_(rows[start:end])
        for lane in chain.lanes:
            lane.join()
        self._count_sources(chain, holder, owners, per_expert, plans[0].n_missed())
        self.telemetry.add_expert_bytes(sum(1 for experts in owners for e in experts if per_expert[e]) * sum(fmt.nbytes))
        return out, order

    def _count_sources(self, chain: Chain, holder: list[tuple[ExpertCache, int] | None], owners: list[list[int]],
                       per_expert: list[int], n_missed: int) -> None:
        """A prompt layer's telemetry: per device, its routed experts by source and its streamed misses."""
        routed = [[e for e in experts if per_expert[e]] for experts in owners]
        here = sum(1 for e in routed[0] if holder[e] is not None and holder[e][0] is chain.own)
        lanes = sum(1 for experts in routed[1:] for e in experts if holder[e] is not None)
        across = sum(1 for e in routed[0] if holder[e] is not None) - here
        self.telemetry.count(self.name, {"resident": here, "peer": across + lanes, "streamed": n_missed})
        for lane, experts in zip(chain.lanes, owners[1:]):
            if experts:
                self.telemetry.count(lane.name, {"streamed": sum(1 for e in experts if holder[e] is None)})

    def _staging(self) -> StagingRing:
        """This device's ring of whole expert groups (the grouped prefill's misses)."""
        if self._group_ring is None or self._group_ring.buffers.shape[1] < self.group_experts:
            self._group_ring = StagingRing(self.ring.copier, rows=self.group_experts)
        return self._group_ring

    def _prefetch(self, layer: int, pairs: int, n_tokens: int) -> None:
        """Stream ``layer``'s first expert groups of misses now, while its attention runs, as its plan cuts
        them when a chunk of ``n_tokens`` tokens, ``pairs`` (token, k) pairs, is planned (``PromptPlanner``)
        and takes the grouped prefill; should the residency change in between, the batches no longer
        covered are copied again."""
        chain = self.chains.get(layer)
        if (chain is None or pairs < PREFETCH_PAIRS * self.arena.n_experts
                or not self._takes_grouped(layer, chain, n_tokens)):
            return
        plans = self.planner.plan(layer, chain, self.group_experts, take=False).plans
        self._staging().prefetch(layer, plans[0].misses)
        for lane, plan in zip(chain.lanes, plans[1:]):
            lane.ring(self.group_experts).prefetch(layer, plan.misses)

    def _on_peer(self, lane: PeerLane, after: torch.cuda.Event | None, layer: int, hidden: torch.Tensor, k: int,
                 order: torch.Tensor, bounds: torch.Tensor, plan: GroupPlan, ffn: ExpertFFN) -> torch.Tensor:
        """Enqueue on ``lane``'s peer, after the home's event ``after`` (its routing), the grouped rows of
        ``plan``'s experts (their spans of ``order``: ``bounds``), its misses over its own link. Returns
        the peer's ``[T*k, H]`` buffer, holding their rows at their places in ``order`` once the lane's
        work is done."""
        with lane.enqueue(after):
            lane.hold(order, bounds)  # read by the side streams after this call returns
            lane.cache.wait_layer(layer, lane.device)
            x, there, spans = lane.send(hidden, order, bounds)  # one copy to the peer
            rows = x.new_empty(order.numel(), x.shape[-1])
            grouped_rows(layer, self.arena.formats[layer], x, k, there, spans, plan, lane.cache,
                         lane.ring(self.group_experts), rows, ffn)
        return rows
