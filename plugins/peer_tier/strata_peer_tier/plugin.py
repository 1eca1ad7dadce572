"""``peer_tier``: a second device as an expert-cache tier that computes its own experts' rows.

``--strategy peer_tier --devices cuda:0,cuda:1`` with options:

* ``peer_reserve_mib`` (600): what auto sizing leaves free on the peer (``--expert-cache auto``);
* ``peer_slots`` (0 = auto: ``--expert-cache`` per device, or the peer's memory less the reserve);
* ``peer_adapt_swaps`` (-1 = ``--adapt-swaps``): experts swapped into the peer's cache per window;
* ``peer_prefill_rows`` (-1): how prompts use the peer. N > 0 (or -1 = ``--prefill-chunk`` x top-k / 2):
  the peer computes its experts' rows (a short chunk's in compact buffers of N (token, k) pairs; a long
  chunk's groups are planned from the residency), and streams ``peer_stream_frac`` of the primary's
  misses and computes those too; 0: its cache is read across
  (one copy a group over the peer link) and the primary computes every row. Computing on the peer
  is no slower than reading across even over NVLink (see BENCHMARKS.md), and it is what PCIe GPUs
  need, so it is the default;
* ``peer_stream_frac`` (0.65): with ``peer_prefill_rows`` != 0, the share of the primary's prompt
  misses the peer streams over its own host link and computes, so both links carry them. The
  primary also runs the dense part, so the peer takes the larger share (0.65 measured faster than
  0.35; see BENCHMARKS.md);
* ``peer_decode_stream_frac`` (0.5): the same for decode misses (the peer's compute there is small
  beside the link time, so an even split balances the two links);
* ``peer_attention`` (True): the peer also attends over half of the kv heads of each long prompt chunk
  (``LayerPlacement.attention_peer``, model/head_split.py). Each head is computed by the same kernel
  either way, so the output is unchanged. In a long prompt the attention, not the experts, is most of
  a layer, so sharing it speeds up long prompts and leaves short ones as they were (see
  BENCHMARKS.md). False keeps every head on the primary.

The dense part (every layer, the embedding and the head) stays on the primary, but for half of the long
prompt chunks' attention heads with ``peer_attention``, so the output equals one device holding the
same experts. The peer's cache is filled from the profile after the
primary's: the two never hold the same expert (adaptation keeps that), their union is the planned
set. Every layer's chain is: the primary's cache, the peer's (``ExpertSource.peer(1, compute=True)``:
activations go over, rows come back, on the peer's own stream, no host wait), then the arena over
the primary's link. The core runs it (experts/peer.py); this plugin is the placement and its options.
"""

from __future__ import annotations

import sys

from pydantic import Field

from strata_core.plugin import (CacheBudget, ConfigError, ExpertSource, GateLayout, LayerPlacement, Placement,
                                StrategyOptions, StrategySpec, hookimpl)


class PeerTierOptions(StrategyOptions):
    """Options of ``peer_tier``."""

    peer_reserve_mib: int = Field(600, ge=0, description="device memory auto sizing leaves free on the peer (MiB)")
    peer_slots: int = Field(0, ge=0, description="expert slots of the peer's cache (0 = --expert-cache, or auto)")
    peer_adapt_swaps: int = Field(-1, ge=-1, description="experts swapped into the peer per window (-1 = --adapt-swaps)")
    peer_prefill_rows: int = Field(-1, ge=-1, description="prompts: 0 = the peer's cache is read across; else the peer "
                                   "computes its rows in buffers of this many pairs (-1 = prefill chunk x top-k / 2)")
    peer_stream_frac: float = Field(0.65, ge=0, le=1, description="share of the prompt misses the peer streams and "
                                    "computes (peer_prefill_rows != 0)")
    peer_decode_stream_frac: float = Field(0.5, ge=0, le=1,
                                           description="share of the decode misses the peer streams and computes")
    peer_attention: bool = Field(True, description="the peer attends over half of the kv heads of long prompt chunks")


@hookimpl
def strata_register_strategies(register):
    """Declare ``peer_tier``."""
    register(StrategySpec(name="peer_tier", description="second device as an expert tier computing its own rows",
                          plugin=sys.modules[__name__], options=PeerTierOptions, gate_options=gate_options))


def gate_options(layout: GateLayout) -> dict[str, int]:
    """Under ``strata gate``: the peer's cache holds ``experts_per_slot`` experts, like the primary's."""
    return {"peer_slots": layout.experts_per_slot}


def peer_budget(settings, options: PeerTierOptions) -> CacheBudget | None:
    """The peer's cache budget: ``peer_slots``, else ``--expert-cache``/``--expert-cache-gib`` like the
    primary's (None), else auto with ``peer_reserve_mib`` left free."""
    if options.peer_slots:
        return CacheBudget(slots=options.peer_slots)
    if isinstance(settings.expert_cache, int) or settings.expert_cache_gib is not None:
        return None
    return CacheBudget(reserve_mib=options.peer_reserve_mib)


@hookimpl
def strata_topology(devices, spec, settings, options):
    """Every layer on the primary; its chain reads the primary's cache, then the peer's (rows
    computed there), then the arena."""
    if len(devices) != 2:
        raise ConfigError(f"peer_tier: --devices names the primary and the peer (two devices), not {len(devices)}")
    primary, peer = devices[0].index, devices[1].index
    decode_peer = ExpertSource.peer(peer, compute=True, stream=options.peer_decode_stream_frac)
    if options.peer_prefill_rows == 0:
        prompt_peer = ExpertSource.peer(peer)
    else:
        prompt_peer = ExpertSource.peer(peer, compute=True, stream=options.peer_stream_frac,
                                        rows=max(options.peer_prefill_rows, 0))

    def layers(source: ExpertSource, attention_peer: int | None = None) -> tuple[LayerPlacement, ...]:
        chain = (ExpertSource.cache(primary), source, ExpertSource.arena(primary), ExpertSource.cpu())
        return tuple(LayerPlacement(primary, chain, attention_peer) for _ in range(spec.n_layers))

    budget = peer_budget(settings, options)
    return Placement(prompt=layers(prompt_peer, peer if options.peer_attention else None), decode=layers(decode_peer),
                     main=primary,
                     budgets={peer: budget} if budget is not None else {}, fill_order=(primary, peer),
                     adapt_swaps={peer: options.peer_adapt_swaps} if options.peer_adapt_swaps >= 0 else {})
