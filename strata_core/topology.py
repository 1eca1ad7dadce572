"""The topology plan: which device runs which layers, and which devices hold extra experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata_core.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """A device that owns a contiguous range of layers (and their KV cache and dense weights)."""

    device: torch.device
    layers: range


@dataclass(frozen=True)
class Tier:
    """A device that caches experts of another stage's layers and computes their rows.

    :param device: the helper device.
    :param stage: index of the stage whose layers' experts it holds.
    :param slots: expert-cache slots on the helper (0 = size automatically).
    """

    device: torch.device
    stage: int
    slots: int = 0


@dataclass(frozen=True)
class TopologyPlan:
    """What a strategy decided at engine start.

    :param stages: the layer ranges in order; together they cover every layer exactly once.
    :param main: the device of the embedding, the output head and sampling.
    :param tiers: extra expert-cache devices.
    :param prefill_device: where batched prompt chunks run (None: each stage runs its own layers).
    """

    stages: tuple[Stage, ...]
    main: torch.device
    tiers: tuple[Tier, ...] = ()
    prefill_device: torch.device | None = None

    def validate(self, n_layers: int) -> None:
        """Raise ConfigError unless the stages cover ``range(n_layers)`` contiguously, in order."""
        expected = 0
        for stage in self.stages:
            if stage.layers.start != expected or stage.layers.step != 1 or len(stage.layers) == 0:
                raise ConfigError(
                    f"topology stages must cover layers 0..{n_layers - 1} contiguously; "
                    f"got {[(str(s.device), s.layers) for s in self.stages]}"
                )
            expected = stage.layers.stop
        if expected != n_layers:
            raise ConfigError(f"topology stages cover {expected} layers, the model has {n_layers}")
        for tier in self.tiers:
            if not 0 <= tier.stage < len(self.stages):
                raise ConfigError(f"tier on {tier.device} serves stage {tier.stage}, which does not exist")

    def stage_of(self, layer: int) -> Stage:
        """The stage that owns ``layer``."""
        for stage in self.stages:
            if layer in stage.layers:
                return stage
        raise ConfigError(f"layer {layer} belongs to no stage")

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Every distinct device of the plan, main first."""
        seen: dict[torch.device, None] = {self.main: None}
        for stage in self.stages:
            seen.setdefault(stage.device, None)
        for tier in self.tiers:
            seen.setdefault(tier.device, None)
        return tuple(seen)
