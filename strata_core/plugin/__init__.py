"""The Strata plugin contract in one place: hook specs, the manager, the placement types.

A topology is a *placement* that the core executes. A strategy plugin answers
``strata_topology`` with a :class:`Placement`: per phase (prompt, decode) and per layer, the device
slot that computes the dense part (and holds the layer's KV during that phase) and the ordered chain
of expert sources (this device's cache, a peer's cache read across or computed there, the host arena
over this device's link, the CPU). The engine runs any placement with every feature intact (CUDA
graphs per device and layer range, observers, telemetry per device slot, the conversation cache);
a request goes through four steps the core owns:

1. the prompt placement runs the prompt (``strata_prefill``, chunk by chunk);
2. residency entries the phase must not see are masked in place and restored after it
   (``strata_residency`` events ``mask`` / ``restore``);
3. layers whose state lives elsewhere in the decode placement are handed off
   (``strata_hand_off``, once per prompt segment);
4. the decode placement runs the windows (``strata_decode_window``).

A plugin is a module with ``hookimpl`` functions, registered under the entry-point group ``strata``::

    # pyproject.toml
    [project.entry-points.strata]
    my_topology = "strata_my_topology.plugin"

    # strata_my_topology/plugin.py
    from strata_core.plugin import Placement, StrategySpec, hookimpl

    @hookimpl
    def strata_register_strategies(register):
        register(StrategySpec(name="my-topology", description="...", plugin=sys.modules[__name__]))

    @hookimpl
    def strata_topology(devices, spec, settings, options):
        return Placement.stages([(0, range(0, 24)), (1, range(24, spec.n_layers))])

Selecting ``--strategy my_topology`` registers that strategy (and the strategy it builds on) and
blocks the others. ``StrategySpec.gate_options`` tells ``strata gate`` the options under which the
strategy holds ``single``'s expert set (see :class:`GateLayout`). The phase hooks have core defaults
that execute the placement; a strategy implements one only for what is really its choice
(micro-batching a window across stages). A phase hook receives ``ctx``, a :class:`PhaseContext`
(context.py): the placement, the strategy's options and the runner's building blocks, the whole of
what a plugin may touch::

    @hookimpl
    def strata_decode_window(ctx, batch):
        hidden = ctx.embed(batch.tokens, ctx.device_of(ctx.segments("decode")[0]))
        for segment in ctx.segments("decode"):
            hidden = ctx.decode_segment(segment, hidden, batch)
        return ctx.head(hidden)

Observers (timing, NaN guard) wrap the phase hooks with ``@hookimpl(wrapper=True)`` and watch
through ``ctx.observe_layers`` / ``ctx.time_stages``. ``plugins/`` and ``examples/`` hold complete
plugins to copy; ``strata_core.testing`` is the pytest plugin to test them, and
``strata_core.testing.contract.strict_context`` fails a test whose plugin reads outside the contract.
"""

from strata_core.errors import ConfigError
from strata_core.plugin.context import (
    CONTEXT_MEMBERS,
    LayerObserver,
    PhaseContext,
    StageTime,
)
from strata_core.plugin.events import ResidencyEvent
from strata_core.plugin.placement import (
    PHASES,
    CacheBudget,
    DeviceSlot,
    ExpertSource,
    LayerPlacement,
    Phase,
    Placement,
    Segment,
)
from strata_core.plugin.spec import (
    PROJECT_NAME,
    GateLayout,
    GateOptions,
    StrategyOptions,
    StrategySpec,
    hookimpl,
    normalize_strategy_name,
)
from strata_core.runtime.session import DecodeBatch, LogitsWanted, Session

__all__ = [
    "CONTEXT_MEMBERS", "PHASES", "PROJECT_NAME", "CacheBudget", "ConfigError", "DecodeBatch", "DeviceSlot",
    "ExpertSource", "GateLayout", "GateOptions", "LayerObserver", "LayerPlacement", "LogitsWanted", "Phase",
    "PhaseContext", "Placement", "ResidencyEvent", "Segment", "Session", "StageTime", "StrategyOptions",
    "StrategySpec", "hookimpl",
    "normalize_strategy_name",
]
