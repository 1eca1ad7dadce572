"""The hook marker and the strategy types (re-exported by :mod:`strata_core.plugin`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pluggy
from pydantic import BaseModel, ConfigDict

PROJECT_NAME = "strata"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class StrategyOptions(BaseModel):
    """Base of a strategy's options model: unknown options are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def normalize_strategy_name(name: str) -> str:
    """``my-topology`` and ``My_Topology`` both name the strategy ``my_topology``."""
    return name.strip().lower().replace("-", "_")


@dataclass(frozen=True)
class GateLayout:
    """How ``strata gate`` lays out ``single``'s expert set for a strategy under test.

    ``single`` caches the first ``slots * experts_per_slot`` experts of the default fill order
    (round-robin over the layers, so each layer gets the same number) on one device. The strategy
    runs on ``slots`` device slots with ``--expert-cache experts_per_slot`` each, adaptation off;
    ``experts_per_slot`` is a multiple of ``n_layers``.

    :param slots: device slots the strategy runs on.
    :param experts_per_slot: the ``--expert-cache`` of each slot.
    :param n_layers: the model's layer count.
    :param n_experts: the model's experts per layer.
    """

    slots: int
    experts_per_slot: int
    n_layers: int
    n_experts: int


#: A strategy's answer to the gate: the ``--strategy-options`` under which its caches hold exactly
#: ``single``'s experts for a :class:`GateLayout`.
GateOptions = Callable[[GateLayout], Mapping[str, "str | int | float | bool"]]


@dataclass(frozen=True)
class StrategySpec:
    """A strategy a plugin provides.

    :param name: the ``--strategy`` value; normalised (``my-topology`` -> ``my_topology``).
    :param description: one line shown by ``strata plugins``.
    :param plugin: the plugin object (usually the module) whose hookimpls implement the strategy.
    :param options: the pydantic model of its ``--strategy-options`` (``extra="forbid"``).
    :param base: the strategy this one builds on (registered with it), or None.
    :param gate_options: for ``strata gate``: given a :class:`GateLayout`, the options under which
        the strategy's caches together hold exactly ``single``'s experts (a layer split cuts the
        layers into ``slots`` equal ranges; an expert tier gives each slot ``experts_per_slot``).
        None: the gate runs the strategy with its default options, says so, and compares it only
        if its caches turn out to hold ``single``'s experts.
    """

    name: str
    description: str
    plugin: object
    options: type[StrategyOptions] = StrategyOptions
    base: str | None = None
    gate_options: GateOptions | None = field(default=None, compare=False)
    distribution: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalize_strategy_name(self.name))
        if self.base is not None:
            object.__setattr__(self, "base", normalize_strategy_name(self.base))
