"""The event passed to ``strata_residency``: what changed in which residency table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from strata_core.plugin.placement import DeviceSlot

ResidencyKind = Literal["plan", "mask", "restore", "adapt"]


@dataclass(frozen=True)
class ResidencyEvent:
    """A change of one device slot's residency table.

    :param kind: ``plan`` (initial fill), ``mask`` / ``restore`` (a phase hides entries and puts
        them back), ``adapt`` (decode-time swaps).
    :param device: the device slot whose table changed.
    :param entries: the (layer, expert) pairs concerned (empty for ``plan``: the whole table;
        for ``adapt`` the experts swapped in).
    """

    kind: ResidencyKind
    device: DeviceSlot
    entries: tuple[tuple[int, int], ...] = field(default=())
