"""``even_split``: each device owns an equal, contiguous share of the layers (a layer split)."""

from __future__ import annotations

import sys

from strata_core.plugin import ConfigError, GateLayout, Placement, StrategyOptions, StrategySpec, hookimpl


class EvenSplitOptions(StrategyOptions):
    """Options of ``even_split``."""

    stages: int = 0  # 0: one stage per device


@hookimpl
def strata_register_strategies(register):
    """Declare ``even_split``."""
    register(StrategySpec(name="even_split", description="layers split evenly across the devices",
                          plugin=sys.modules[__name__], options=EvenSplitOptions, gate_options=gate_options))


def gate_options(layout: GateLayout) -> dict[str, int]:
    """Under ``strata gate``: one stage per device slot, so each stage's cache holds ``single``'s
    experts of its layers."""
    return {"stages": layout.slots}


@hookimpl
def strata_topology(devices, spec, settings, options):
    """Contiguous layer ranges of (nearly) equal size, one per device slot, in device order; the
    core runs the placement (the hidden state moves between stages, each stage's KV stays on it)."""
    n_stages = options.stages or len(devices)
    if n_stages > len(devices) or n_stages > spec.n_layers:
        raise ConfigError(f"even_split: {n_stages} stages need as many devices ({len(devices)} given) "
                          f"and layers ({spec.n_layers})")
    bounds = [round(i * spec.n_layers / n_stages) for i in range(n_stages + 1)]
    return Placement.stages([(devices[i].index, range(bounds[i], bounds[i + 1])) for i in range(n_stages)])
