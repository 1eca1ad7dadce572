"""``gpu1_experts``: the other devices hold static expert sets whose weights the primary reads.

``--strategy gpu1_experts --devices cuda:0,cuda:1[,cuda:2[,cuda:3]]`` with options ``slots_device1``
.. ``slots_device3`` (0 = ``--expert-cache`` / auto): device i's cache is filled from the profile after
the caches before it (the experts next in rank after the primary's) and never adapts. The primary
computes every row: each layer's chain is the primary's cache, then each other device's cache read
across the peer link (``ExpertSource.peer(i)``: the weights move, the activations stay), then the
arena over the primary's host link. The dense part stays on the primary, so the output equals one
device holding the same experts. Against ``peer_tier`` (rows computed on the peer) this trades a
peer-link read of each expert's weights for no activation traffic.
"""

from __future__ import annotations

import sys

from pydantic import Field

from strata_core.plugin import (CacheBudget, ConfigError, ExpertSource, GateLayout, LayerPlacement, Placement,
                                StrategyOptions, StrategySpec, hookimpl)


class Gpu1ExpertsOptions(StrategyOptions):
    """Options of ``gpu1_experts``: the expert slots of devices 1 to 3."""

    slots_device1: int = Field(0, ge=0, description="expert slots on the second device (0 = --expert-cache / auto)")
    slots_device2: int = Field(0, ge=0, description="expert slots on the third device (0 = --expert-cache / auto)")
    slots_device3: int = Field(0, ge=0, description="expert slots on the fourth device (0 = --expert-cache / auto)")


@hookimpl
def strata_register_strategies(register):
    """Declare ``gpu1_experts``."""
    register(StrategySpec(name="gpu1_experts", description="other devices hold static experts the primary reads",
                          plugin=sys.modules[__name__], options=Gpu1ExpertsOptions, gate_options=gate_options))


def gate_options(layout: GateLayout) -> dict[str, int]:
    """Under ``strata gate``: every device after the primary holds ``experts_per_slot`` static experts."""
    return {f"slots_device{i}": layout.experts_per_slot for i in range(1, layout.slots)}


@hookimpl
def strata_topology(devices, spec, settings, options):
    """Every layer on the primary, reading the other devices' caches across before the arena."""
    if not 2 <= len(devices) <= 4:
        raise ConfigError(f"gpu1_experts: --devices names the primary and one to three more, not {len(devices)}")
    primary, others = devices[0].index, [slot.index for slot in devices[1:]]
    chain = (ExpertSource.cache(primary), *(ExpertSource.peer(i) for i in others),
             ExpertSource.arena(primary), ExpertSource.cpu())
    layers = tuple(LayerPlacement(primary, chain) for _ in range(spec.n_layers))
    slots = (options.slots_device1, options.slots_device2, options.slots_device3)
    return Placement(prompt=layers, decode=layers, main=primary,
                     budgets={i: CacheBudget(slots=n) for i, n in zip(others, slots) if n},
                     fill_order=(primary, *others), adapt_swaps=dict.fromkeys(others, 0))
