"""Residency checks for plugin authors: the caches of an engine's device slots as tiers."""

from __future__ import annotations

from strata_core.engine import Engine


def check_tiers(engine: Engine) -> None:
    """Raise AssertionError unless every device slot's table is consistent (``ResidencyTable.check``),
    no (layer, expert) is held by two caches (masked entries count), and each cache holds only
    layers its placement serves."""
    served = engine.placement.cached_layers()
    held: dict[tuple[int, int], int] = {}
    for slot, table in engine.experts.tables.items():
        table.check()
        entries = set(table.resident()) | {(int(l), int(e)) for l, e in table.masked.nonzero().tolist()}
        for entry in entries:
            assert entry not in held, f"expert {entry} is held by slots {held[entry]} and {slot}"
            assert entry[0] in served[slot], f"slot {slot} holds {entry}, a layer it does not serve"
            held[entry] = slot
