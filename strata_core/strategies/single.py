"""The builtin ``single`` strategy: every layer on one device.

It registers through the same hook as every other strategy and only places the model: the core
defaults run its phases. With several ``--devices`` it uses the first one and says so.
"""

from __future__ import annotations

import logging
import sys

from strata_core.plugin import LayerPlacement, Placement, StrategySpec, hookimpl

log = logging.getLogger(__name__)


@hookimpl
def strata_register_strategies(register):
    """Declare ``single``."""
    register(StrategySpec(name="single", description="every layer and the expert cache on one device",
                          plugin=sys.modules[__name__]))


@hookimpl
def strata_topology(devices, spec, settings, options):
    """Every layer on the first device slot, in both phases."""
    if len(devices) > 1:
        log.info("single: using %s only (of %s)", devices[0], ", ".join(map(str, devices)))
    layers = tuple(LayerPlacement.local(devices[0].index) for _ in range(spec.n_layers))
    return Placement(prompt=layers, decode=layers, main=devices[0].index)
