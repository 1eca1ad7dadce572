"""What the core does around a phase: residency masking in place, and the hand-off of per-layer state.

Masking: a phase that does not read a device slot's cache for some layers (no ``cache`` or ``peer``
source of that slot in those layers' chains) hides those entries of that slot's one residency table
in place for the phase; the per-request ``MaskRecord`` (read only to restore, never by compute)
puts them back when the phase ends, also when it raises. Each change is announced through
``strata_residency`` (``mask`` / ``restore``).

Hand-off: before a phase, every layer whose state (KV) lives on another device slot than the one
computing it in that phase is moved there through ``strata_hand_off``, one call per contiguous run
of layers with the same source and destination. With ``STRATA_DBG_HANDOFF=1`` the destination is
read back and compared with the source after each call (within a process: a hand-off to another
rank leaves nothing here to compare).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from strata_core.errors import StrataError
from strata_core.model import kvtransfer
from strata_core.plugin.events import ResidencyEvent
from strata_core.plugin.placement import PHASES, DeviceSlot, Phase, Placement

if TYPE_CHECKING:
    from strata_core.experts.table import ResidencyTable
    from strata_core.runtime.session import Session

__all__ = ["HandOffError", "hidden_layers", "masked_phase", "place_state"]


class HandOffError(StrataError):
    """A hand-off did not land what it reported (``STRATA_DBG_HANDOFF``)."""


def hidden_layers(placement: Placement, cached: dict[int, set[int]]) -> dict[Phase, dict[int, set[int]]]:
    """Per phase and device slot with a cache, the layers of that cache the phase must not see."""
    out: dict[Phase, dict[int, set[int]]] = {}
    for phase in PHASES:
        out[phase] = {slot: layers - placement.visible_layers(phase, slot) for slot, layers in cached.items()}
        out[phase] = {slot: layers for slot, layers in out[phase].items() if layers}
    return out


@contextmanager
def masked_phase(tables: Mapping[int, ResidencyTable], hidden: dict[int, set[int]],
                 announce: Callable[[ResidencyEvent], None], devices: Sequence[DeviceSlot]) -> Iterator[None]:
    """Mask in ``tables``, for the block, the layers ``hidden`` names per device slot (one phase's
    entry of :func:`hidden_layers`); restore them after, also on error. ``announce`` is told each
    change (``strata_residency``)."""
    records = []
    try:
        for slot, layers in hidden.items():
            table = tables[slot]
            record = table.mask((layer, expert) for layer in sorted(layers) for expert in range(table.shape[1]))
            records.append((slot, record))
            announce(ResidencyEvent("mask", devices[slot], tuple(map(tuple, record.entries.tolist()))))
        yield
    finally:
        for slot, record in reversed(records):
            tables[slot].restore(record)
            announce(ResidencyEvent("restore", devices[slot], tuple(map(tuple, record.entries.tolist()))))


def _moves(homes: dict[int, int], placement: Placement, phase: Phase) -> list[tuple[range, int, int]]:
    """Contiguous runs ``(layers, src, dst)`` of layers whose home (here, or away on another rank) is not
    their ``phase`` device (the layers ``homes`` lacks are another rank's alone)."""
    runs: list[tuple[range, int, int]] = []
    for layer, placed in enumerate(placement.layers(phase)):
        if layer not in homes:
            continue
        src, dst = homes[layer], placed.device
        if src == dst:
            continue
        if runs and runs[-1][1:] == (src, dst) and runs[-1][0].stop == layer:
            runs[-1] = (range(runs[-1][0].start, layer + 1), src, dst)
        else:
            runs.append((range(layer, layer + 1), src, dst))
    return runs


def place_state(session: Session, placement: Placement, phase: Phase, devices: Sequence[DeviceSlot],
                hand_off: Callable[..., bool | None], verify: bool = False) -> int:
    """Hand off (``hand_off(session=, layers=, src=, dst=)``: ``strata_hand_off``) every layer of
    ``session`` whose state is not where ``phase`` computes it; with ``verify`` read each destination
    back. Returns the number of hand-offs made."""
    runs = _moves(session.kv.home | session.kv.away, placement, phase)
    for layers, src, dst in runs:
        if not hand_off(session=session, layers=layers, src=devices[src], dst=devices[dst]):
            raise HandOffError(f"no plugin moved layers {layers.start}..{layers.stop - 1} "
                               f"from {devices[src]} to {devices[dst]}")
        if verify and devices[src].rank == devices[dst].rank:
            _verify(session, layers, src, dst)
    return len(runs)


def _verify(session: Session, layers: range, src: int, dst: int) -> None:
    """Read the destination back and compare it with the source, row for row."""
    kv = session.kv
    for layer in layers:
        before = kvtransfer.parked(kv, layer, src)
        if kv.home[layer] != dst or before is None:
            raise HandOffError(f"hand-off of layer {layer} to slot {dst}: the state is not there")
        sources = kv.committed(layer, before)
        for name, moved in kv.committed(layer).items():
            if not torch.equal(moved.cpu(), sources[name].cpu()):
                raise HandOffError(f"hand-off of layer {layer} from slot {src} to {dst}: its {name!r} state "
                                   "read back differs from the source (a copy that landed nothing?)")
