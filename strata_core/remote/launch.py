"""Who this process is among the ranks: torchrun's environment or SGLang's flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.plugin.placement import PHASES, DeviceSlot, Placement
from strata_core.runtime.devices import split_rank

__all__ = ["Launch", "check_placement", "launch_of"]


@dataclass(frozen=True)
class Launch:
    """This process's ``rank`` of ``world`` ranks, meeting the others at ``address`` (``HOST:PORT``)."""

    rank: int
    world: int
    address: str


def launch_of(settings: StrataSettings, environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch ``settings`` (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``, one rank a
    node) or torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
    describe; None for a process alone. ConfigError when ``--devices`` names a rank that was not
    launched."""
    launch = None
    if settings.nnodes > 1:
        if not settings.dist_init_addr or ":" not in settings.dist_init_addr:
            raise ConfigError(f"--nnodes {settings.nnodes} needs --dist-init-addr HOST:PORT (where rank 0 listens)")
        launch = Launch(settings.node_rank, settings.nnodes, settings.dist_init_addr)
    elif int(environ.get("WORLD_SIZE", "1")) > 1:
        launch = Launch(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                        f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}")
    world = launch.world if launch is not None else 1
    named = {split_rank(name)[0] for name in settings.devices}
    if max(named) >= world:
        raise ConfigError(f"--devices names rank {max(named)}, but {world} rank(s) were launched: start them with "
                          "torchrun --nproc-per-node N, or strata serve --nnodes N --node-rank R "
                          "--dist-init-addr HOST:PORT on each")
    if launch is not None and (idle := sorted(set(range(world)) - named)):
        raise ConfigError(f"rank {idle[0]} of {world} has no --devices entry (name its devices rank{idle[0]}:DEVICE)")
    return launch


def check_placement(placement: Placement, slots: tuple[DeviceSlot, ...]) -> None:
    """ConfigError unless ``placement`` runs across ranks: the embedding and head on rank 0; a layer's
    state moves between ranks only as a whole decode segment of another rank whose prompt runs on one
    device slot of rank 0 (prefill_main: the hand-off goes over the ranks' channel); each layer's
    expert sources and attention peer on the rank computing it (no rank reads another's memory)."""
    if slots[placement.main].rank != 0:
        raise ConfigError(f"placement: the main device {slots[placement.main]} must be rank 0's (the server's)")
    for segment in placement.segments("decode"):
        sources = {placement.prompt[layer].device for layer in segment.layers}
        if all(slots[source].rank == slots[segment.device].rank for source in sources):
            continue
        (source, *others) = sorted(sources)
        if others or slots[source].rank != 0:
            first, last = segment.layers.start, segment.layers.stop - 1
            raise ConfigError(f"placement: layers {first}..{last} decode on {slots[segment.device]} and their prompts "
                              f"run on {', '.join(str(slots[s]) for s in sorted(sources))}; layer state moves "
                              "between ranks only from one device slot of rank 0 to a whole decode segment")
    for layer, (prompt, decode) in enumerate(zip(placement.prompt, placement.decode)):
        for phase, placed in zip(PHASES, (prompt, decode)):
            others = [s.device for s in placed.experts if s.device is not None]
            if placed.attention_peer is not None:
                others.append(placed.attention_peer)
            for other in others:
                if slots[other].rank != slots[placed.device].rank:
                    raise ConfigError(f"placement: layer {layer} ({phase}) on {slots[placed.device]} reads from "
                                      f"{slots[other]}, a device of another rank")
