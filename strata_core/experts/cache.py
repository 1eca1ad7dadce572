"""A device's expert cache: ``[n_slots, slot_bytes]`` of packed experts plus its residency table.

Slots are filled from the arena in a rank order at start (``fill``) and swapped during decode
(``swap``). On the CPU the slots are plain host tensors, so every mechanism runs in CI.

One more row than the table's slots is allocated and left zero (``zero_slot``): an expert whose
packed bytes are all zero has zero weights in every block format, so a pair pointed at it gets a
zero row and reads nothing from host memory (the decode gather skips the pairs another device
serves this way, experts/peer.py).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from tqdm import tqdm

from strata_core.experts.arena import GIB, Arena
from strata_core.experts.table import ResidencyTable
from strata_core.experts.transfer import ArenaCopier
from strata_core.runtime.numa import interleave, placement_nodes

__all__ = ["ExpertCache"]

log = logging.getLogger(__name__)


class ExpertCache:
    """The slots of one device and the table saying which (layer, expert) each holds."""

    def __init__(self, arena: Arena, copier: ArenaCopier, n_slots: int, name: str = ""):
        self.arena, self.copier, self.device = arena, copier, copier.device
        self.name = name or str(self.device)  # the device slot, e.g. cuda:0#1
        self.padded = torch.empty((n_slots + 1, arena.slot_bytes), dtype=torch.uint8, device=self.device)  # [S+1, B]
        if self.device.type == "cpu":  # the CPU computes its experts here: their pages over every node
            interleave(self.padded, placement_nodes(), f"expert cache {self.name}")
        self.padded[n_slots].zero_()
        self.slots = self.padded[:n_slots]  # [S, B]
        self.table = ResidencyTable(arena.n_layers, arena.n_experts, n_slots, self.device)
        self._landing: dict[int, list[torch.cuda.Event]] = {}  # layer -> copies of swaps in flight

    @property
    def n_slots(self) -> int:
        return self.slots.shape[0]

    @property
    def zero_slot(self) -> int:
        """The row of ``padded`` that is all zero (a pair pointed there gets a zero row)."""
        return self.n_slots

    def parts(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) views of ``slot`` holding an expert of ``layer``."""
        return self.arena.formats[layer].split(self.slots[slot])

    def fill(self, order: Sequence[tuple[int, int]]) -> int:
        """Load experts in ``order`` into free slots until full; returns how many were loaded."""
        todo = [(l, e) for l, e in order if self.table.slot(l, e) < 0][: self.table.n_free]
        with self.table.batch(), tqdm(todo, desc=f"expert cache {self.name}", unit="expert",
                                      leave=False, disable=len(todo) < 64) as bar:
            for layer, expert in bar:
                slot = self.table.take_free_slot()
                self.copier.copy(layer, expert, self.slots[slot])
                self.table.assign(layer, expert, slot)
        if self.copier.stream is not None:
            self.copier.stream.synchronize()  # start-up only: slots are complete before any compute
        log.info("expert cache %s: %d of %d experts resident (%d slots, %.2f GiB)", self.name,
                 self.table.n_resident, len(self.arena.moe_layers) * self.arena.n_experts, self.n_slots,
                 self.slots.numel() / GIB)
        return len(todo)

    def swap(self, victim: tuple[int, int] | None, incoming: tuple[int, int]) -> int:
        """Evict ``victim`` (if given), give its slot to ``incoming`` and enqueue the copy; returns the slot.

        On CUDA the copy waits for the compute already enqueued (which may still read the victim's
        bytes), and the next compute of ``incoming``'s layer waits for the copy (``wait_layer``):
        device-side ordering only, the host never waits.
        """
        if self.copier.stream is not None:
            self.copier.stream.wait_stream(torch.cuda.current_stream(self.device))
        if victim is not None:
            self.table.evict(*victim)
        slot = self.table.take_free_slot()
        if slot is None:
            raise RuntimeError(f"expert cache {self.device}: swap without a free slot")
        self.table.assign(*incoming, slot)
        self.copier.copy(*incoming, self.slots[slot])
        if self.copier.stream is not None:
            done = torch.cuda.Event()
            done.record(self.copier.stream)
            self._landing.setdefault(incoming[0], []).append(done)
        return slot

    def wait_layer(self, layer: int, device: torch.device | None = None) -> None:
        """Make ``device``'s current stream (default: this cache's) wait for swaps into ``layer`` still
        in flight; a peer reading these slots waits too (no-op on the CPU; never a host wait)."""
        landing = [done for done in self._landing.get(layer, ()) if not done.query()]
        if landing:
            self._landing[layer] = landing
        else:
            self._landing.pop(layer, None)
        for done in landing:
            torch.cuda.current_stream(device or self.device).wait_event(done)
