"""What the core does around a phase: residency masking in place, and the hand-off of per-layer state.

Masking: a phase that does not read a device slot's cache for some layers (no ``cache`` or ``peer``
source of that slot in those layers' chains) hides those entries of that slot's one residency table
in place for the phase; the per-request ``MaskRecord`` (read only to restore, never by compute)
puts them back when the phase ends, also when it raises. Each change is announced through
``strata_residency`` (``mask`` / ``restore``).

Hand-off: before a phase, every layer whose state (KV) lives on another device slot than the one
computing it in that phase is moved there through ``strata_hand_off``, one call per contiguous run
of layers with the same source and destination. With ``STRATA_DBG_HANDOFF=1`` the destination is
read back and compared with the source after each call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from strata_core.errors import StrataError
from strata_core.plugin.events import ResidencyEvent
from strata_core.plugin.placement import PHASES, Phase, Placement

if TYPE_CHECKING:
    from strata_core.engine import Engine
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
def masked_phase(engine: Engine, phase: Phase) -> Iterator[None]:
    """Mask, for the block, the entries ``phase`` must not see; restore them after, also on error."""
    hidden = engine.hidden_layers[phase]
    records = []
    try:
        for slot, layers in hidden.items():
            table = engine.experts.tables[slot]
            record = table.mask((layer, expert) for layer in sorted(layers) for expert in range(table.shape[1]))
            records.append((slot, record))
            engine.hook.strata_residency(engine=engine, event=ResidencyEvent(
                "mask", engine.devices[slot], tuple(map(tuple, record.entries.tolist()))))
        yield
    finally:
        for slot, record in reversed(records):
            engine.experts.tables[slot].restore(record)
            engine.hook.strata_residency(engine=engine, event=ResidencyEvent(
                "restore", engine.devices[slot], tuple(map(tuple, record.entries.tolist()))))


def _moves(homes: dict[int, int], placement: Placement, phase: Phase) -> list[tuple[range, int, int]]:
    """Contiguous runs ``(layers, src, dst)`` of layers whose home is not their ``phase`` device."""
    runs: list[tuple[range, int, int]] = []
    for layer, placed in enumerate(placement.layers(phase)):
        src, dst = homes[layer], placed.device
        if src == dst:
            continue
        if runs and runs[-1][1:] == (src, dst) and runs[-1][0].stop == layer:
            runs[-1] = (range(runs[-1][0].start, layer + 1), src, dst)
        else:
            runs.append((range(layer, layer + 1), src, dst))
    return runs


def place_state(engine: Engine, session: Session, phase: Phase) -> int:
    """Hand off every layer of ``session`` whose state is not where ``phase`` computes it; returns
    the number of ``strata_hand_off`` calls made."""
    runs = _moves(session.kv.home, engine.placement, phase)
    for layers, src, dst in runs:
        done = engine.hook.strata_hand_off(engine=engine, session=session, layers=layers,
                                           src=engine.devices[src], dst=engine.devices[dst])
        if not done:
            raise HandOffError(f"no plugin moved layers {layers.start}..{layers.stop - 1} "
                               f"from {engine.devices[src]} to {engine.devices[dst]}")
        if engine.settings.dbg_handoff:
            _verify(session, layers, src, dst)
    return len(runs)


def _verify(session: Session, layers: range, src: int, dst: int) -> None:
    """Read the destination back and compare it with the source, row for row."""
    kv = session.kv
    for layer in layers:
        before = kv.parked(layer, src)
        if kv.home[layer] != dst or before is None:
            raise HandOffError(f"hand-off of layer {layer} to slot {dst}: the state is not there")
        sources = kv.committed(layer, before)
        for name, moved in kv.committed(layer).items():
            if not torch.equal(moved.cpu(), sources[name].cpu()):
                raise HandOffError(f"hand-off of layer {layer} from slot {src} to {dst}: its {name!r} state "
                                   "read back differs from the source (a copy that landed nothing?)")
