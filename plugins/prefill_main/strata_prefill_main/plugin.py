"""``prefill_main``: prompts run every layer on the main device, decode stays layer-split.

Builds on ``layer_split`` (same ``split`` and ``micro_batches`` options; its decode windows). A
prompt needs the experts of every layer and is bound by streaming the misses from host RAM, so a
layer split only adds a slower link to its critical path; here the prompt placement computes every
layer on the main device, and the decode placement is the split. The core does the rest:

* the later stages compute no prompt, so they keep no prompt-path buffers: that memory goes to their caches;
* their caches are read across the peer link during the prompt (``peer_read``, on by default within
  one process) instead of streaming those layers cold from host RAM; with ``peer_read=false`` their
  entries are masked in place for the prompt and restored before decode;
* one hand-off per prompt segment copies the KV of layers ``[K, n)`` to the stage that owns them.

Across ranks (``rankN:DEVICE`` stages) the prompt runs on rank 0's main device and the hand-off goes
over the ranks' channel; no rank reads another's memory, so ``peer_read`` is off there (asking for
it is an error), and the devices keep their configured order (another rank cannot probe rank 0's links,
and every rank must compute the same placement).

The main device is the one with the widest host link (PCIe generation x lanes, from NVML or
sysfs); a reorder is logged, and where the probe fails the configured order stays.
"""

from __future__ import annotations

import logging
import sys

from pydantic import Field
from strata_layer_split.plugin import LayerSplitOptions, gate_options, stage_ranges

from strata_core.plugin import ConfigError, DeviceSlot, Placement, StrategySpec, hookimpl
from strata_prefill_main.links import link_class

log = logging.getLogger(__name__)


class PrefillMainOptions(LayerSplitOptions):
    """Options of ``prefill_main``: those of ``layer_split`` and two of its own."""

    peer_read: bool | None = Field(None, description="read the later stages' caches across during the prompt "
                                   "(default: within one process; never across ranks)")
    order_by_link: bool = Field(True, description="make the device with the widest host link the main one")


@hookimpl
def strata_register_strategies(register):
    """Declare ``prefill_main`` (built on ``layer_split``)."""
    register(StrategySpec(name="prefill_main", description="prompt on the main device, decode layer-split",
                          plugin=sys.modules[__name__], options=PrefillMainOptions, base="layer_split",
                          gate_options=gate_options))  # layer_split's: the same stages hold the experts


def by_link(devices: list[DeviceSlot]) -> list[DeviceSlot]:
    """``devices`` with the widest host link first (stable), or as given when a probe fails."""
    links = [link_class(slot.device) for slot in devices]
    if any(link is None for link in links):
        return devices
    widest = max(range(len(devices)), key=lambda i: (links[i][0] * links[i][1], -i))
    if widest != 0:
        log.info("prefill_main: %s has the widest host link (PCIe gen %d x%d): it becomes the main device",
                 devices[widest], *links[widest])
    return [devices[widest], *devices[:widest], *devices[widest + 1:]]


def _across_ranks(devices: list[DeviceSlot], options: PrefillMainOptions) -> bool:
    """Whether ``devices`` span ranks; ConfigError when ``options`` ask a rank to read another's memory."""
    others = [slot for slot in devices if slot.rank != devices[0].rank]
    if others and options.peer_read:
        raise ConfigError(f"prefill_main: peer_read=true reads the later stages' caches across a peer link, and "
                          f"{others[0]} is another rank's device (no rank reads another's memory): set "
                          "peer_read=false or leave it unset")
    return bool(others)


@hookimpl
def strata_topology(devices, spec, settings, options):
    """The layer split for decode; every layer's prompt on the first (widest-link) device."""
    across = _across_ranks(list(devices), options)
    ordered = by_link(list(devices)) if options.order_by_link and not across else list(devices)
    stages = stage_ranges(ordered, spec, options.split)
    main = ordered[0].index
    log.info("prefill_main: prompts on %s; decode %s", devices[main],
             "; ".join(f"{devices[d]} layers {r.start}..{r.stop - 1}" for d, r in stages))
    peer_read = not across if options.peer_read is None else options.peer_read
    return Placement.stages(stages, main=main, prompt_device=main, prompt_peer=peer_read)
