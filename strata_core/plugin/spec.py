"""The hook marker and the strategy types (re-exported by :mod:`strata_core.plugin`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pluggy
from pydantic import BaseModel, ConfigDict

PROJECT_NAME = "strata"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class StrategyOptions(BaseModel):
    """Base of a strategy's options model: unknown options are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def normalize_strategy_name(name: str) -> str:
    """``peer-tier`` and ``Peer_Tier`` both name the strategy ``peer_tier``."""
    return name.strip().lower().replace("-", "_")


@dataclass(frozen=True)
class StrategySpec:
    """A strategy a plugin provides.

    :param name: the ``--strategy`` value; normalised (``peer-tier`` -> ``peer_tier``).
    :param description: one line shown by ``strata plugins``.
    :param plugin: the plugin object (usually the module) whose hookimpls implement the strategy.
    :param options: the pydantic model of its ``--strategy-options`` (``extra="forbid"``).
    :param base: the strategy this one builds on (registered with it), or None.
    """

    name: str
    description: str
    plugin: object
    options: type[StrategyOptions] = StrategyOptions
    base: str | None = None
    distribution: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalize_strategy_name(self.name))
        if self.base is not None:
            object.__setattr__(self, "base", normalize_strategy_name(self.base))
