"""Placements: a topology's answer, and what the core executes.

Per phase (``prompt``, ``decode``) and per layer a :class:`LayerPlacement` names the device slot
that computes the layer's dense part (its KV and other per-layer state live there during the phase)
and the ordered chain of :class:`ExpertSource` the layer's routed experts are found in. A routed
expert is served by the first source of the chain that holds it; ``arena`` and ``cpu`` hold every
expert, so a chain ends with one of them. With both, decode misses are split between them by
``--pcie-frac``; prompt misses go over the link, but a GPU splits a short chunk's as its decode does
(experts/prompt_split.py).

Device slots are the entries of ``--devices`` by position: ``cpu,cpu`` is two slots, each with its
own expert cache, residency table, KV and telemetry, on one torch device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from strata_core.errors import ConfigError

__all__ = ["PHASES", "CacheBudget", "DeviceSlot", "ExpertSource", "LayerPlacement", "Phase", "Placement", "Segment"]

Phase = Literal["prompt", "decode"]
PHASES: tuple[Phase, ...] = ("prompt", "decode")

SourceKind = Literal["cache", "peer", "arena", "cpu"]


@dataclass(frozen=True)
class DeviceSlot:
    """One entry of ``--devices``: its position ``index``, the torch ``device`` it runs on, the ``rank``
    (process) that owns it (``rank1:cuda:0``; 0 for a plain name), and for another rank's slot the
    ``memory`` that rank reported free on it at join (None: this process's own device, ask torch)."""

    index: int
    device: torch.device
    rank: int = 0
    memory: int | None = None

    def __str__(self) -> str:
        return f"{f'rank{self.rank}:' if self.rank else ''}{self.device}#{self.index}"


@dataclass(frozen=True)
class ExpertSource:
    """Where a device finds a routed expert's rows.

    * ``cache``: the computing device's own cache slots (``device`` is that slot);
    * ``peer``: another device slot's cache; its weights are read across the peer link and the rows
      computed here, or with ``compute=True`` the activations go over and the peer computes the rows
      (on a stream of its own, experts/peer.py). A computing peer may also take ``stream``, a share
      (0..1) of the computing device's misses, streamed over the peer's own host link and computed
      there (prompts: a running share of each layer's misses; decode: the missed experts whose id
      falls in the share, decided on the device), and ``rows``, the most (token, k) pairs of its
      compact prompt buffers (0: ``--prefill-chunk`` x top-k / 2);
    * ``arena``: the host arena over ``device``'s host link (copied, or read zero-copy in decode);
    * ``cpu``: computed on the CPU from the arena.
    """

    kind: SourceKind
    device: int | None = None
    compute: bool = False
    stream: float = 0.0
    rows: int = 0

    @classmethod
    def cache(cls, device: int) -> ExpertSource:
        """The cache slots of ``device`` (the device computing the layer)."""
        return cls("cache", device)

    @classmethod
    def peer(cls, device: int, compute: bool = False, stream: float = 0.0, rows: int = 0) -> ExpertSource:
        """The cache of another device slot: weights read across, or rows computed there (``compute``),
        then also ``stream`` of the misses, in compact prompt buffers of ``rows`` pairs."""
        return cls("peer", device, compute, stream, rows)

    @classmethod
    def arena(cls, device: int) -> ExpertSource:
        """The host arena over ``device``'s host link."""
        return cls("arena", device)

    @classmethod
    def cpu(cls) -> ExpertSource:
        """The CPU, computing from the arena."""
        return cls("cpu")

    @property
    def holds_every_expert(self) -> bool:
        return self.kind in ("arena", "cpu")

    @property
    def cache_device(self) -> int | None:
        """The device slot whose cache this source reads (None for arena and cpu)."""
        return self.device if self.kind in ("cache", "peer") else None


@dataclass(frozen=True)
class LayerPlacement:
    """One layer in one phase: the computing device slot and the expert source chain; in the prompt
    phase, ``attention_peer`` (a device slot) attends over the last half of the kv heads of each chunk
    (model/head_split.py: the output is the unsplit attention's; gpt-oss and MLA attention stay whole)."""

    device: int
    experts: tuple[ExpertSource, ...]
    attention_peer: int | None = None

    @classmethod
    def local(cls, device: int) -> LayerPlacement:
        """Computed on ``device``: its cache, then the arena over its link, then the CPU."""
        return cls(device, (ExpertSource.cache(device), ExpertSource.arena(device), ExpertSource.cpu()))


@dataclass(frozen=True)
class CacheBudget:
    """A device slot's expert-cache budget, overriding ``--expert-cache``: ``slots``, ``gib``, or
    ``reserve_mib`` (auto sizing that leaves this much of the device free instead of ``--reserve-mib``)."""

    slots: int | None = None
    gib: float | None = None
    reserve_mib: int | None = None

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.slots, self.gib, self.reserve_mib)) != 1:
            raise ConfigError("a cache budget is slots, GiB or a reserve in MiB, exactly one of them")
        if (self.slots or 0) < 0 or (self.gib or 0) < 0 or (self.reserve_mib or 0) < 0:
            raise ConfigError(f"a cache budget cannot be negative: {self}")


@dataclass(frozen=True)
class Segment:
    """A maximal run of consecutive layers computed on one device slot in one phase."""

    device: int
    layers: range


@dataclass(frozen=True)
class Placement:
    """What a strategy decided: per phase and layer, where it is computed and where experts come from.

    :param prompt: one :class:`LayerPlacement` per layer for prompt chunks.
    :param decode: one per layer for decode windows.
    :param main: the device slot of the embedding, the output head and sampling.
    :param budgets: per device slot, a cache budget overriding ``--expert-cache``.
    :param fill_order: device slots in the order their caches are filled from the profile (the
        rest follow in index order); an expert is never cached twice.
    :param adapt_swaps: per device slot, experts swapped into its cache per decode window,
        overriding ``--adapt-swaps`` (a cache no computing slot owns adapts to the routing of the
        slots whose chains read it).
    """

    prompt: tuple[LayerPlacement, ...]
    decode: tuple[LayerPlacement, ...]
    main: int = 0
    budgets: Mapping[int, CacheBudget] = field(default_factory=dict)
    fill_order: tuple[int, ...] = ()
    adapt_swaps: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def stages(cls, stages: Sequence[tuple[int, range]], main: int | None = None,
               prompt_device: int | None = None, prompt_peer: bool = True, **kwargs) -> Placement:
        """A layer split: ``(device slot, layers)`` per stage, each layer on its stage in both phases.

        ``prompt_device``: run every layer's prompt on that slot instead; decode stays split. The
        other stages' caches are then read across as peers (``prompt_peer``) or not read at all
        (their entries are masked during the prompt, and those layers' experts stream from the arena).
        """
        decode = tuple(LayerPlacement.local(device) for device, layers in stages for _ in layers)
        prompt = decode
        if prompt_device is not None:
            prompt = tuple(
                LayerPlacement.local(prompt_device) if layer.device == prompt_device else
                LayerPlacement(prompt_device, ((ExpertSource.peer(layer.device),) if prompt_peer else ())
                               + (ExpertSource.arena(prompt_device), ExpertSource.cpu()))
                for layer in decode)
        first = stages[0][0] if stages else 0
        return cls(prompt=prompt, decode=decode, main=first if main is None else main, **kwargs)

    def layers(self, phase: Phase) -> tuple[LayerPlacement, ...]:
        """The per-layer placements of ``phase``."""
        return self.prompt if phase == "prompt" else self.decode

    def segments(self, phase: Phase) -> tuple[Segment, ...]:
        """Maximal runs of consecutive layers on one device slot, in layer order."""
        out: list[Segment] = []
        for layer, placed in enumerate(self.layers(phase)):
            if out and out[-1].device == placed.device:
                out[-1] = Segment(placed.device, range(out[-1].layers.start, layer + 1))
            else:
                out.append(Segment(placed.device, range(layer, layer + 1)))
        return tuple(out)

    def devices_used(self) -> set[int]:
        """Every device slot the placement computes on or caches on (the main one included)."""
        used = {self.main}
        for phase in PHASES:
            for placed in self.layers(phase):
                used.add(placed.device)
                used.update(s.cache_device for s in placed.experts if s.cache_device is not None)
        return used

    def cached_layers(self) -> dict[int, set[int]]:
        """Per device slot, the layers its cache serves (named by a ``cache`` or ``peer`` source)."""
        served: dict[int, set[int]] = {}
        for phase in PHASES:
            for layer, placed in enumerate(self.layers(phase)):
                for source in placed.experts:
                    if source.cache_device is not None:
                        served.setdefault(source.cache_device, set()).add(layer)
        return served

    def visible_layers(self, phase: Phase, device: int) -> set[int]:
        """Layers whose ``phase`` chain reads ``device``'s cache (the rest of it is masked then)."""
        return {layer for layer, placed in enumerate(self.layers(phase))
                if any(s.cache_device == device for s in placed.experts)}

    def validate(self, n_layers: int, n_devices: int) -> None:
        """Raise ConfigError naming the problem unless this placement can run on ``n_devices`` slots."""
        def check_device(index: int | None, what: str) -> None:
            if index is None or not 0 <= index < n_devices:
                raise ConfigError(f"placement: {what} names device slot {index}; --devices has {n_devices}")

        check_device(self.main, "the main device")
        for slot in self.budgets:
            check_device(slot, "a cache budget")
        for slot in self.fill_order:
            check_device(slot, "the fill order")
        for slot, swaps in self.adapt_swaps.items():
            check_device(slot, "an adapt-swaps entry")
            if swaps < 0:
                raise ConfigError(f"placement: adapt swaps of slot {slot} cannot be negative ({swaps})")
        for phase in PHASES:
            layers = self.layers(phase)
            if len(layers) != n_layers:
                raise ConfigError(f"placement: the {phase} phase places {len(layers)} layers, the model has {n_layers}")
            for i, placed in enumerate(layers):
                where = f"layer {i} ({phase})"
                check_device(placed.device, where)
                if placed.attention_peer is not None:
                    check_device(placed.attention_peer, f"{where}: the attention peer")
                    if placed.attention_peer == placed.device or phase != "prompt":
                        raise ConfigError(f"placement: {where}: an attention peer is another device slot, "
                                          "in the prompt phase")
                if not placed.experts or not placed.experts[-1].holds_every_expert:
                    raise ConfigError(f"placement: {where}: the expert chain must end with the arena or the CPU")
                if len(set(placed.experts)) != len(placed.experts):
                    raise ConfigError(f"placement: {where}: a source appears twice in {placed.experts}")
                for source in placed.experts:
                    if source.kind == "cpu":
                        continue
                    check_device(source.device, f"{where}: a {source.kind} source")
                    if source.kind in ("cache", "arena") and source.device != placed.device:
                        raise ConfigError(f"placement: {where}: a {source.kind} source must be the computing "
                                          f"device's ({placed.device}), not {source.device}; use a peer source")
                    if source.kind == "peer" and source.device == placed.device:
                        raise ConfigError(f"placement: {where}: a peer source names the computing device itself")
                    if (source.stream or source.rows) and not (source.kind == "peer" and source.compute):
                        raise ConfigError(f"placement: {where}: stream and rows belong to a peer that computes "
                                          f"its rows, not to {source}")
                    if not 0 <= source.stream <= 1 or source.rows < 0:
                        raise ConfigError(f"placement: {where}: a peer's stream share must be in [0, 1] and its "
                                          f"rows >= 0, not {source.stream} and {source.rows}")
