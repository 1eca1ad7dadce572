"""``even_split``: each device owns an equal, contiguous share of the layers (a layer split)."""

from __future__ import annotations

import sys

from strata_core.errors import ConfigError
from strata_core.plugin import StrategyOptions, StrategySpec, hookimpl
from strata_core.topology import Stage, TopologyPlan


class EvenSplitOptions(StrategyOptions):
    """Options of ``even_split``."""

    stages: int = 0  # 0: one stage per device


@hookimpl
def strata_register_strategies(register):
    """Declare ``even_split``."""
    register(StrategySpec(name="even_split", description="layers split evenly across the devices",
                          plugin=sys.modules[__name__], options=EvenSplitOptions))


@hookimpl
def strata_topology(devices, spec, settings, options):
    """Contiguous layer ranges of (nearly) equal size, one per device, in device order."""
    n_stages = options.stages or len(devices)
    if n_stages > len(devices) or n_stages > spec.n_layers:
        raise ConfigError(f"even_split: {n_stages} stages need as many devices ({len(devices)} given) "
                          f"and layers ({spec.n_layers})")
    bounds = [round(i * spec.n_layers / n_stages) for i in range(n_stages + 1)]
    stages = tuple(Stage(devices[i], range(bounds[i], bounds[i + 1])) for i in range(n_stages))
    return TopologyPlan(stages=stages, main=devices[0])


@hookimpl
def strata_prefill(engine, session, tokens, all_logits):
    """The chunk runs through the stages in order; the hidden state moves between devices."""
    hidden = engine.embed(tokens, engine.plan.stages[0].device)  # [T, H]
    for stage in engine.plan.stages:
        hidden = engine.prefill_layers(stage.layers, hidden.to(stage.device), session)
    return engine.head(hidden if all_logits else hidden[-1:])


@hookimpl
def strata_decode_window(engine, batch):
    """One token per session through the stages in order."""
    hidden = engine.embed(batch.tokens, engine.plan.stages[0].device)  # [B, H]
    for stage in engine.plan.stages:
        hidden = engine.decode_layers(stage.layers, hidden.to(stage.device), batch)
    return engine.head(hidden)
