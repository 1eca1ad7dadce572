"""``layer_split``: each device slot owns a contiguous range of layers (a stage) with its own expert cache.

``--strategy layer_split --devices A,B[,…]`` with options ``split`` (``auto``, or the cut points
``K1,K2,…``: stage i owns layers ``[K(i), K(i+1))``) and ``micro_batches`` (default 2). ``auto`` cuts
the layers in proportion to each device's memory left after the embedding and head (another rank's
device: the memory that rank reported free at join); each stage's
cache is filled from the profile with its own layers' experts. The core runs the placement.

Decode windows of two or more sessions are split into micro-batches enqueued stage-major: stage 0
runs micro-batch 0, then 1, … while stage 1 starts micro-batch 0 as soon as its hidden state lands.
Nothing on that path waits on the host (a host sync per layer would make the two GPUs take turns
being idle); ``STRATA_DECODE_TIMING=1`` prints each stage's device time per window.
"""

from __future__ import annotations

import logging
import sys

import torch
from pydantic import Field

from strata_core.plugin import (ConfigError, DecodeBatch, DeviceSlot, GateLayout, Placement, StrategyOptions,
                                StrategySpec, hookimpl)
from strata_core.plugin.memory import GIB, global_weight_bytes, slot_bytes

log = logging.getLogger(__name__)


class LayerSplitOptions(StrategyOptions):
    """Options of ``layer_split`` (and of the strategies built on it)."""

    split: str = Field("auto", description="auto, or cut points K1,K2,... (stage i owns [Ki, Ki+1))")
    micro_batches: int = Field(2, ge=1, description="micro-batches a decode window is split into across stages")


@hookimpl
def strata_register_strategies(register):
    """Declare ``layer_split``."""
    register(StrategySpec(name="layer_split", description="contiguous layer ranges per device, decode pipelined",
                          plugin=sys.modules[__name__], options=LayerSplitOptions, gate_options=gate_options))


def gate_options(layout: GateLayout) -> dict[str, str]:
    """Under ``strata gate``: ``slots`` equal layer ranges, so that each stage's cache (filled
    round-robin over its layers) holds exactly ``single``'s experts of those layers."""
    return {"split": ",".join(str(i * layout.n_layers // layout.slots) for i in range(1, layout.slots))}


def _room(devices: list[DeviceSlot], spec, dtype_bytes: int) -> list[int]:
    """Memory each slot has for layers: its torch device's share (on its own rank), less the embedding and
    head on the first."""
    globals_bytes = global_weight_bytes(spec, dtype_bytes)
    room = []
    for slot in devices:
        sharing = sum(1 for other in devices if (other.rank, other.device) == (slot.rank, slot.device))
        have = slot_bytes(slot) // sharing
        room.append(max(have - (globals_bytes if slot is devices[0] else 0), 1))
    return room


def _auto_cuts(devices: list[DeviceSlot], spec) -> list[int]:
    """Cut points giving each slot layers in proportion to its memory (each at least one layer)."""
    room = _room(devices, spec, dtype_bytes=2)
    total, cuts, acc = sum(room), [], 0
    for i, r in enumerate(room[:-1]):
        acc += r
        lowest = (cuts[-1] if cuts else 0) + 1
        highest = spec.n_layers - (len(room) - 1 - i)
        cuts.append(min(max(round(acc / total * spec.n_layers), lowest), highest))
    log.info("layer_split: auto cuts %s from the room per device (%s GiB)", cuts,
             ", ".join(f"{slot}: {r / GIB:.1f}" for slot, r in zip(devices, room)))
    return cuts


def stage_ranges(devices: list[DeviceSlot], spec, split: str) -> list[tuple[int, range]]:
    """``(device slot, layers)`` per stage, in device order, from ``split`` (``auto`` or ``K1,K2,…``)."""
    if len(devices) < 2:
        raise ConfigError(f"layer_split: --devices names one device ({devices[0]}); the layer split needs two or "
                          "more (logical ones like cuda:0,cuda:0 work)")
    if split.strip().lower() == "auto":
        cuts = _auto_cuts(devices, spec)
    else:
        try:
            cuts = [int(part) for part in split.split(",") if part.strip()]
        except ValueError:
            raise ConfigError(f"layer_split: split must be auto or cut points like 24 or 16,32; got {split!r}") from None
    bounds = [0, *cuts, spec.n_layers]
    if any(b >= a for a, b in zip(bounds[1:], bounds)) or len(cuts) + 1 > len(devices):
        raise ConfigError(f"layer_split: cut points {cuts} must increase strictly inside 1..{spec.n_layers - 1} "
                          f"and make at most one stage per device ({len(devices)} given)")
    return [(devices[i].index, range(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]


@hookimpl
def strata_topology(devices, spec, settings, options):
    """One stage per device slot (or per cut), each layer computed and cached on its stage."""
    stages = stage_ranges(list(devices), spec, options.split)
    log.info("layer_split: %s", "; ".join(f"{devices[d]} layers {r.start}..{r.stop - 1}" for d, r in stages))
    return Placement.stages(stages)


def micro_batches(batch: DecodeBatch, n: int) -> list[DecodeBatch]:
    """``batch`` cut into at most ``n`` contiguous micro-batches of near-equal size."""
    n = max(1, min(n, len(batch)))
    bounds = [round(i * len(batch) / n) for i in range(n + 1)]
    return [DecodeBatch(sessions=batch.sessions[a:b], tokens=batch.tokens[a:b], fed=batch.fed,
                        offsets=batch.offsets[a:b]) for a, b in zip(bounds, bounds[1:])]


@hookimpl
def strata_decode_window(ctx, batch):
    """Micro-batches enqueued stage-major across the decode placement's segments (no host wait);
    a window of one session, or one stage, is the core's plain run."""
    segments = ctx.segments("decode")
    parts = micro_batches(batch, ctx.options.micro_batches)
    if len(parts) < 2 or len(segments) < 2:
        return None
    hidden = [ctx.embed(part.tokens, ctx.device_of(segments[0])) for part in parts]  # [b, H] each
    for segment in segments:
        for i, part in enumerate(parts):
            hidden[i] = ctx.decode_segment(segment, hidden[i], part)
    return ctx.head(torch.cat([h.to(ctx.main.device) for h in hidden]))
