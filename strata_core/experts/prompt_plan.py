"""Who computes which experts of a prompt layer, and in what order: the grouped prefill's plan.

A prompt layer's experts are split between the computing device and its computing peers (``Chain.lanes``):
each peer takes the experts its cache holds and its ``stream`` share of the misses (``peer_shares``,
``assign``), and every device's list is ordered by source as ``grouped_rows`` reads them. Sorting the
layer's pairs by ``ranks`` then makes each device's pairs one span. A *planned* layer (a chunk large
enough that every expert is taken as routed) has a plan that follows from the residency and the peers'
shares alone: :class:`PromptPlanner` makes it once and keeps it while those hold (``LayerPlan``), for
the layer and for the prefetch of its misses before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from strata_core.runtime.devices import to_device
from strata_core.experts.chain import Chain
from strata_core.experts.grouped import GroupPlan

if TYPE_CHECKING:
    from strata_core.experts.cache import ExpertCache
    from strata_core.experts.peer import PeerLane

__all__ = ["LayerPlan", "PromptPlanner", "assign", "group_plans", "peer_shares", "ranks"]

Holder = list["tuple[ExpertCache, int] | None"]


def peer_shares(link: list[int], chain: Chain,
                peek: bool = False) -> tuple[list[int], list[tuple[PeerLane, list[int]]]]:
    """A prompt layer's link misses split: each computing peer's ``stream`` share (the last ones, streamed
    over the peer's own host link and computed there), and the rest over the computing device's
    (``peek``: the split predicted, the shares not taken)."""
    away = []
    for lane in chain.lanes:
        n = lane.split.peek(len(link)) if peek else lane.split.take(len(link))
        if n:
            away.append((lane, link[len(link) - n:]))
            link = link[:len(link) - n]
    return link, away


def assign(chain: Chain, holder: Holder, peek: bool = False) -> list[list[int]]:
    """Who computes a prompt layer's experts (``holder``: per expert, where it is found): the experts the
    computing device computes, then per computing peer (``chain.lanes``) those it takes: its cache's and
    its ``stream`` share of the misses (``peek``: the shares predicted, not taken). Each list is ordered
    by source, as ``grouped_rows`` takes them: the experts of one cache consecutive (chain order), the
    misses last, each part ascending."""
    _, away = peer_shares([e for e, where in enumerate(holder) if where is None], chain, peek)  # the rest stay
    taken = {id(lane): [e for e, where in enumerate(holder) if where is not None and where[0] is lane.cache]
             for lane in chain.lanes}
    for lane, streamed in away:
        taken[id(lane)] += streamed
    elsewhere = {e for chosen in taken.values() for e in chosen}
    source = {id(cache): n for n, cache in enumerate(chain.caches())}  # the misses after every cache's

    def by_source(experts: list[int]) -> list[int]:
        return sorted(experts, key=lambda e: (len(source) if holder[e] is None else source[id(holder[e][0])], e))

    return [by_source([e for e in range(len(holder)) if e not in elsewhere])] + \
        [by_source(taken[id(lane)]) for lane in chain.lanes]


def ranks(owners: list[list[int]], n_experts: int, device: torch.device) -> torch.Tensor:
    """``[n_experts]`` on ``device``, a permutation: each expert's place in the devices' expert lists one after
    the other (the experts in none of them after), so that sorting a layer's pairs by it groups them by
    device, then by expert in each list's order."""
    listed = [e for experts in owners for e in experts]
    rest = sorted(set(range(n_experts)).difference(listed))
    rank = [0] * n_experts
    for i, e in enumerate(listed + rest):
        rank[e] = i
    return to_device(torch.tensor(rank), device)


def group_plans(chain: Chain, device: torch.device, holder: Holder, owners: list[list[int]], group_experts: int,
                per_expert: list[int] | None = None) -> list[GroupPlan]:
    """Each device's ``GroupPlan`` of its experts (``owners``): the computing ``device``'s, then each lane's on
    its peer (in compact groups of ``lane.rows`` pairs where the pairs per expert are known)."""
    devices = [(device, 0)] + [(lane.device, lane.rows) for lane in chain.lanes]
    return [GroupPlan(experts, [holder[e] for e in experts], where, group_experts,
                      None if per_expert is None else [per_expert[e] for e in experts], rows)
            for experts, (where, rows) in zip(owners, devices)]


class LayerPlan(NamedTuple):
    """A planned prompt layer, valid while ``versions`` (the group size and the chain's tables) and
    ``shares`` (the peers' shares of the misses) are unchanged."""

    versions: tuple[int, ...]
    shares: tuple[tuple[int, int], ...]
    holder: Holder
    owners: list[list[int]]
    rank: torch.Tensor  # [E] on the computing device
    plans: list[GroupPlan]  # the computing device's, then each lane's


class PromptPlanner:
    """The plans of one computing device's planned prompt layers (one kept per layer)."""

    def __init__(self, device: torch.device, n_experts: int):
        self.device, self.n_experts = device, n_experts
        self._plans: dict[int, LayerPlan] = {}

    def plan(self, layer: int, chain: Chain, group_experts: int, take: bool = True) -> LayerPlan:
        """``layer``'s plan: where each expert is found, who computes which (``assign``), their ranks and each
        device's ``GroupPlan`` (groups of at most ``group_experts``); made from the residency and the
        peers' shares of the misses, and kept while those are unchanged (made once for a prompt, not
        once per layer and chunk). ``take``: the peers' shares are taken (a layer computed), else only
        predicted (its prefetch)."""
        versions = (group_experts, *(cache.table.version for cache in chain.caches()))
        known = self._plans.get(layer)
        holder = known.holder if known is not None and known.versions == versions else \
            chain.holders(layer, list(range(self.n_experts)))
        missing = [e for e, where in enumerate(holder) if where is None]
        shares = tuple((id(lane), len(streamed)) for lane, streamed in peer_shares(missing, chain, peek=True)[1])
        if known is None or known.versions != versions or known.shares != shares:
            owners = assign(chain, holder, peek=True)
            known = LayerPlan(versions, shares, holder, owners, ranks(owners, self.n_experts, self.device),
                              group_plans(chain, self.device, holder, owners, group_experts))
            self._plans[layer] = known
        if take:
            peer_shares(missing, chain)  # the shares predicted above, taken
        return known
