"""The residency table of one device tier: ``[n_layers, n_experts]`` -> slot id, or -1.

The table lives on the host (``host``) with a mirror on the device (``mirror``) that device code
reads. It changes only through ``assign``, ``evict``, ``mask`` and ``restore``; every change is
published to the mirror before the call returns (``batch()`` defers publishing to its end, so a
cache fill costs one copy). A slot id is meaningful only on the device that owns the slot.

Masking hides entries from compute without giving their slots away: a masked entry reads -1, its
slot stays owned, and the ``MaskRecord`` returned by ``mask`` is the only thing that can bring the
entry back (``restore``). The record is read to restore, never by compute.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from strata_core.errors import ConfigError

__all__ = ["MaskRecord", "ResidencyTable", "NOT_RESIDENT"]

NOT_RESIDENT = -1


@dataclass(frozen=True)
class MaskRecord:
    """The entries one ``mask`` call hid: ``entries`` int64 ``[n, 2]`` (layer, expert), ``slots`` ``[n]``."""

    entries: torch.Tensor
    slots: torch.Tensor


class ResidencyTable:
    """Slot ids of the experts resident on one device; see the module docstring for the rules."""

    def __init__(self, n_layers: int, n_experts: int, n_slots: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.n_slots = n_slots
        self.host = torch.full((n_layers, n_experts), NOT_RESIDENT, dtype=torch.int32)  # [L, E]
        self.mirror = self.host.to(self.device, copy=True)  # [L, E] on the device
        self._replicas: dict[torch.device, torch.Tensor] = {}  # [L, E] copies of the mirror on other devices
        self._owner = torch.full((n_slots, 2), NOT_RESIDENT, dtype=torch.int64)  # slot -> (layer, expert)
        self._masked = torch.zeros((n_layers, n_experts), dtype=torch.bool)  # [L, E]
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: pop() gives the lowest free slot
        self._deferred = 0
        self.version = 0  # counts the changes: a plan made from the table holds while it is unchanged

    # --- queries -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.host.shape)  # type: ignore[return-value]

    def slot(self, layer: int, expert: int) -> int:
        """The slot of (layer, expert) on this device, or -1 (also while masked)."""
        return int(self.host[layer, expert])

    def owner(self, slot: int) -> tuple[int, int] | None:
        """The (layer, expert) owning ``slot`` (masked or not), or None if the slot is free."""
        layer, expert = (int(v) for v in self._owner[slot])
        return None if layer == NOT_RESIDENT else (layer, expert)

    def holds(self, layer: int, expert: int) -> bool:
        """Whether a slot of this device owns (layer, expert), visible or masked."""
        return bool(self.host[layer, expert] >= 0) or bool(self._masked[layer, expert])

    @property
    def masked(self) -> torch.Tensor:
        """``[L, E]`` bool: entries hidden by a mask (a copy; read-only use)."""
        return self._masked.clone()

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_resident(self) -> int:
        """Slots owned (masked entries included)."""
        return self.n_slots - len(self._free)

    def resident(self) -> list[tuple[int, int]]:
        """The (layer, expert) entries visible to compute (not -1), in table order."""
        return [(int(l), int(e)) for l, e in (self.host >= 0).nonzero().tolist()]

    # --- changes -------------------------------------------------------------------------------
    def take_free_slot(self) -> int | None:
        """The lowest free slot id without assigning it (None when full)."""
        return self._free[-1] if self._free else None

    def assign(self, layer: int, expert: int, slot: int) -> None:
        """Make ``slot`` (free) hold (layer, expert) (not resident, not masked)."""
        if self._masked[layer, expert]:
            raise ConfigError(f"expert ({layer}, {expert}) is masked; restore it before changing it")
        if self.host[layer, expert] != NOT_RESIDENT:
            raise ConfigError(f"expert ({layer}, {expert}) is already in slot {int(self.host[layer, expert])}")
        if not 0 <= slot < self.n_slots or self._owner[slot, 0] != NOT_RESIDENT:
            raise ConfigError(f"slot {slot} of {self.device} is not free")
        self._free.remove(slot)
        self._owner[slot] = torch.tensor([layer, expert])
        self.host[layer, expert] = slot
        self._publish()

    def evict(self, layer: int, expert: int) -> int:
        """Free the slot of (layer, expert) (resident, not masked) and return its id."""
        if self._masked[layer, expert]:
            raise ConfigError(f"expert ({layer}, {expert}) is masked; restore it before evicting it")
        slot = int(self.host[layer, expert])
        if slot == NOT_RESIDENT:
            raise ConfigError(f"expert ({layer}, {expert}) is not resident on {self.device}")
        self._owner[slot] = NOT_RESIDENT
        self._free.append(slot)
        self._free.sort(reverse=True)
        self.host[layer, expert] = NOT_RESIDENT
        self._publish()
        return slot

    def mask(self, entries: Iterable[tuple[int, int]]) -> MaskRecord:
        """Hide the resident ones of ``entries`` from compute (read -1); slots stay owned."""
        pairs = sorted({(int(l), int(e)) for l, e in entries})
        idx = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)  # [n, 2]
        slots = self.host[idx[:, 0], idx[:, 1]].to(torch.int64) if len(pairs) else torch.empty(0, dtype=torch.int64)
        keep = slots != NOT_RESIDENT
        idx, slots = idx[keep], slots[keep]
        self.host[idx[:, 0], idx[:, 1]] = NOT_RESIDENT
        self._masked[idx[:, 0], idx[:, 1]] = True
        self._publish()
        return MaskRecord(entries=idx, slots=slots)

    def restore(self, record: MaskRecord) -> None:
        """Put back exactly what ``mask`` hid."""
        idx = record.entries
        if not bool(self._masked[idx[:, 0], idx[:, 1]].all()):
            raise ConfigError("restore of entries that are not masked (restored twice?)")
        self.host[idx[:, 0], idx[:, 1]] = record.slots.to(torch.int32)
        self._masked[idx[:, 0], idx[:, 1]] = False
        self._publish()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Apply several changes, publishing the mirror once at the end."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
            self._publish()

    def mirror_on(self, device: torch.device | str) -> torch.Tensor:
        """The mirror as device code on ``device`` reads it: ``mirror`` itself on this table's device, else a
        replica there that every publish updates in place (a peer's table read by its home without a
        copy per layer; ask for it outside CUDA-graph captures: the first call allocates it)."""
        device = torch.device(device)
        if device == self.mirror.device:
            return self.mirror
        if device not in self._replicas:
            self._replicas[device] = self.host.to(device, copy=True)
        return self._replicas[device]

    def _publish(self) -> None:
        self.version += 1
        if self._deferred == 0:
            self.mirror.copy_(self.host)  # blocking: the host may change the table right after
            for replica in self._replicas.values():
                replica.copy_(self.host)

    # --- checks --------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless owner, free list, table and mirror agree (used by tests)."""
        visible = self.host[self.host >= 0].tolist()
        assert len(visible) == len(set(visible)), "a slot is owned twice"
        for (layer, expert), slot in zip((self.host >= 0).nonzero().tolist(), visible):
            assert self.owner(slot) == (layer, expert), f"slot {slot} owner mismatch"
        owned = int((self._owner[:, 0] != NOT_RESIDENT).sum())
        assert owned + len(self._free) == self.n_slots, "free list and owners disagree"
        assert owned == len(visible) + int(self._masked.sum()), "masked entries lost their slots"
        assert torch.equal(self.mirror.cpu(), self.host), "device mirror differs from the host table"
        for replica in self._replicas.values():
            assert torch.equal(replica.cpu(), self.host), "a replica of the mirror differs from the host table"
