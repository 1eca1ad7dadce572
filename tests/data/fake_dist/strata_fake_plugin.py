"""A strategy plugin found through a committed dist-info (tests entry-point discovery)."""

import sys

from strata_core.plugin import StrategySpec, hookimpl


@hookimpl
def strata_register_strategies(register):
    register(StrategySpec(name="fake-strategy", description="found by entry point", plugin=sys.modules[__name__]))
