"""The builtin ``single`` strategy: every layer on one device.

It registers through the same hook as every other strategy. With several ``--devices`` it uses the
first one and says so.
"""

from __future__ import annotations

import logging
import sys


from strata_core.plugin import StrategySpec, hookimpl

log = logging.getLogger(__name__)


@hookimpl
def strata_register_strategies(register):
    """Declare ``single``."""
    register(StrategySpec(name="single", description="every layer and the expert cache on one device",
                          plugin=sys.modules[__name__]))


@hookimpl
def strata_topology(devices, spec, settings, options):
    """One stage holding every layer on the first device."""
    from strata_core.topology import Stage, TopologyPlan

    if len(devices) > 1:
        log.info("single: using %s only (of %s)", devices[0], ", ".join(map(str, devices)))
    return TopologyPlan(stages=(Stage(devices[0], range(spec.n_layers)),), main=devices[0])


@hookimpl
def strata_prefill(engine, session, tokens, all_logits):
    """Embed, run every layer on the one stage, return the head's logits."""
    stage = engine.plan.stages[0]
    hidden = engine.embed(tokens, stage.device)  # [T, H]
    hidden = engine.prefill_layers(stage.layers, hidden, session)
    return engine.head(hidden if all_logits else hidden[-1:])


@hookimpl
def strata_decode_window(engine, batch):
    """One token per session through every layer on the one stage."""
    stage = engine.plan.stages[0]
    hidden = engine.embed(batch.tokens, stage.device)  # [B, H]
    hidden = engine.decode_layers(stage.layers, hidden, batch)
    return engine.head(hidden)


@hookimpl
def strata_hand_off(engine, session, layers, src, dst):
    """Copy the KV of ``layers`` to ``dst``."""
    if src == dst:
        return True
    session.kv.move_layers(layers, dst)
    return True


