"""``Chain``: one layer's expert sources resolved for a device slot (the placement's ``ExpertSource``
chain made into caches and peer lanes)."""

from __future__ import annotations

from dataclasses import dataclass
import torch

from strata_core.experts.cache import ExpertCache
from strata_core.experts.peer import PeerLane

__all__ = ["Chain"]


@dataclass(frozen=True)
class Chain:
    """One layer's expert sources resolved: the own cache, peers' caches (in chain order), the lanes
    of the peers that compute their own rows (the rest are read across), and whether misses may go
    over the host link and to the CPU (both: decode splits by ``--pcie-frac``)."""

    own: ExpertCache | None
    peers: tuple[ExpertCache, ...] = ()
    lanes: tuple[PeerLane, ...] = ()  # the peers computing their own rows (activations go over)
    link: bool = True
    cpu: bool = True

    def __post_init__(self) -> None:
        if self.own is not None:  # the decode gather reads the peers' residency on the own device
            for cache in self.peers:
                cache.table.mirror_on(self.own.device)

    def caches(self) -> tuple[ExpertCache, ...]:
        """Every cache the layer reads, the own one first, then the peers in chain order."""
        return ((self.own,) if self.own is not None else ()) + self.peers

    def lane(self, cache: ExpertCache) -> PeerLane | None:
        """The lane of ``cache`` when its rows are computed on its own device (activations go over)."""
        return next((lane for lane in self.lanes if lane.cache is cache), None)

    def computes(self, cache: ExpertCache) -> bool:
        """Whether ``cache``'s rows are computed on its own device (activations go over)."""
        return self.lane(cache) is not None

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
