"""Decode-time cache adaptation (``--adapt-swaps N``): swap in hot missed experts by decayed usage.

After each decode window the usage counts of the window are folded into a decayed score
(``score = decay * score + window counts``, one host read per window, never per layer); then up
to N times the highest-scoring non-resident expert replaces the lowest-scoring resident one if it
scores strictly higher (or takes a free slot). Ties break by (layer, expert), so decisions are
deterministic. The copies are asynchronous (``ExpertCache.swap``). An expert another cache holds
(``others``: the caches serving the same layers) is never swapped in, so no two tiers hold the same
expert, and masked entries are not this phase's to move.
"""

from __future__ import annotations

import torch

from strata_core.experts.cache import ExpertCache
from strata_core.experts.profile import UsageCounter
from strata_core.experts.telemetry import ExpertTelemetry

__all__ = ["Adapter"]


class Adapter:
    """Swaps up to ``swaps`` experts into one device's cache after every decode window."""

    def __init__(self, cache: ExpertCache, usage: UsageCounter, telemetry: ExpertTelemetry,
                 swaps: int, decay: float = 0.9, others: tuple[ExpertCache, ...] = (),
                 layers: set[int] | None = None):
        self.cache, self.usage, self.telemetry, self.others = cache, usage, telemetry, others
        n_layers, n_experts = usage.counts.shape
        self.served = torch.zeros(n_layers, n_experts, dtype=torch.bool)  # [L, E]: layers this cache serves
        self.served[sorted(range(n_layers) if layers is None else layers)] = True
        self.swaps, self.decay = swaps, decay
        self.score = torch.zeros(usage.counts.shape, dtype=torch.float64)  # [L, E] host
        self._seen = usage.counts.to("cpu", copy=True)  # [L, E] counts already folded in

    def end_window(self) -> list[tuple[int, int]]:
        """Fold the window's counts in and swap; returns the (layer, expert) entries swapped in."""
        counts = self.usage.counts.to("cpu", copy=True)  # [L, E]: the one host read per window
        self.score.mul_(self.decay).add_(counts - self._seen)
        self._seen = counts
        if self.swaps == 0 or self.cache.n_slots == 0:
            return []
        table = self.cache.table
        flat = self.score.flatten()  # [L*E]
        resident = (table.host >= 0).flatten()  # [L*E]
        movable = ~table.masked.flatten()  # masked entries are not this phase's to change
        n_exp = table.shape[1]
        elsewhere = ~self.served.flatten()
        for other in self.others:
            elsewhere |= (other.table.host >= 0).flatten() | other.table.masked.flatten()
        cands = [int(i) for i in _by_score(flat, descending=True)
                 if not resident[i] and movable[i] and not elsewhere[i]]
        victims = [int(i) for i in _by_score(flat, descending=False) if resident[i] and movable[i]]
        done: list[tuple[int, int]] = []
        for cand in cands[: self.swaps]:
            if flat[cand] <= 0:
                break
            victim = None
            if table.n_free == 0:
                if not victims or flat[victims[0]] >= flat[cand]:
                    break
                v = victims.pop(0)
                victim = (v // n_exp, v % n_exp)
            self.cache.swap(victim, (cand // n_exp, cand % n_exp))
            done.append((cand // n_exp, cand % n_exp))
        self.telemetry.swaps += len(done)
        return done


def _by_score(flat: torch.Tensor, descending: bool) -> torch.Tensor:
    """Indices sorted by score, ties by index ascending."""
    return torch.sort(-flat if descending else flat, stable=True).indices
