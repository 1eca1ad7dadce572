"""Residency checks for plugin authors: the caches of an engine's device slots as tiers."""

from __future__ import annotations

import os
from typing import Any

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


def single_holds(path: str | os.PathLike[str], expert_cache: int, **settings: Any) -> set[tuple[int, int]]:
    """The (layer, expert) entries ``single`` caches on one CPU device with ``expert_cache`` slots
    (the other ``settings``, an ``expert_profile`` say, as for the engine compared with it): the set
    a tiered strategy's caches must hold together to be exact against single (DESIGN invariant 1)."""
    engine = Engine.load(path, strategy="single", devices=["cpu"], expert_cache=expert_cache,
                         **{"max_context": 64} | settings)
    try:
        return set(engine.experts.tables[0].resident())
    finally:
        engine.close()
