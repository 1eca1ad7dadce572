"""``build_expert_backend``: the arena, one cache + table per device slot, the rows the MoE layers call.

The engine calls, in order::

    left = check_dense_budget(settings, dense_bytes)       # before loading anything (BudgetError)
    backend = build_expert_backend(weights, spec, placement, devices, settings, dense_bytes)
    rows = backend.rows_for(slot, phase)                   # ExpertRows of `slot`'s layers in `phase`
    backend.begin_window(); ... decode ...; backend.end_window()   # around each decode window
    backend.use_gather(True)                               # tests: force the decode gather on the CPU
    backend.use_grouped_prefill(True)                      # tests: force the grouped prefill on the CPU
    backend.telemetry.reset() / .snapshot()                # per request
    backend.close()

A peer source that computes its rows gets a ``PeerLane`` per computing slot (experts/peer.py).
Adaptation (``--adapt-swaps``, or the placement's ``adapt_swaps`` per slot) runs for every cache,
also one no slot computes with (a peer tier), on the routing counts of the slot reading it.

Which experts a device slot caches: the layers whose expert chain (in either phase) names its cache,
as its own or as a peer's. Caches are filled in the placement's ``fill_order`` (then by slot index)
from the profile's rank order (or ``default_order``); an expert is never cached twice. A slot's
budget is the placement's ``budgets`` entry, else ``--expert-cache`` / ``--expert-cache-gib`` /
auto (memory of a torch device shared equally by the slots on it).

Decode windows take the decode gather (gather.py: no host read per layer) on a CUDA device when
Triton is installed, every arena layer is pinned and ``--pcie-frac`` is 1 (every miss over the
link; ``auto`` is 1 where every expert is resident, else it splits the misses: split_auto.py);
elsewhere (CPU, mmap or partly pinned arena, CPU share of misses) the loop per expert (on the CPU its
experts through the CPU kernels, ops/cpu_kernels.py).
Prefill chunks take the grouped prefill (grouped.py) on a CUDA device and the loop per expert (the
bit-exact reference) on the CPU. On a GPU whose decode sends misses to the CPU, the load-time rate probe
also decides ``cpu_prompt_tokens`` (prompt_split.py): a prompt chunk of at most that many tokens splits
its misses as the decode does (the loop per expert), a longer one streams them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from strata_core.config import StrataSettings
from strata_core.experts.adapt import Adapter
from strata_core.experts.arena import GIB, Arena
from strata_core.experts.cache import ExpertCache
from strata_core.experts.chain import Chain
from strata_core.experts.device_rows import CachedExpertRows
from strata_core.experts.peer import PeerLane
from strata_core.experts.grouped import workspace_bytes
from strata_core.experts.profile import UsageCounter, UsageProfile, default_order
from strata_core.experts.prompt_split import decide_cpu_prompt_tokens
from strata_core.experts.sizing import cache_slots, check_dense_budget
from strata_core.experts.miss_share import MissShare
from strata_core.experts.split import MissSplit
from strata_core.experts.split_auto import (SETTLE_WINDOWS, START_FRAC, AutoSplit, probe_rates, probe_split,
                                            resolve_pcie_frac)
from strata_core.experts.table import ResidencyTable
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import ArenaCopier, StagingRing
from strata_core.experts.weights import ExpertWeights
from strata_core.errors import ConfigError
from strata_core.model.spec import ModelSpec
from strata_core.ops.gather import HAS_TRITON
from strata_core.plugin.placement import PHASES, DeviceSlot, ExpertSource, Phase, Placement
from strata_core.runtime.devices import compute_dtype

__all__ = ["ExpertBackend", "build_expert_backend"]

log = logging.getLogger(__name__)


class ExpertBackend:
    """Everything expert-related the engine holds: arena, caches, tables, rows, telemetry, and
    ``cpu_prompt_tokens``: the longest prompt chunk a GPU splits the misses of as its decode does (0: none)."""

    def __init__(self, arena: Arena, caches: dict[int, ExpertCache], rows: dict[tuple[Phase, int], CachedExpertRows],
                 adapters: dict[int, Adapter], telemetry: ExpertTelemetry, cpu_pool: ThreadPoolExecutor | None,
                 cpu_prompt_tokens: int = 0):
        self.arena, self.caches, self._rows = arena, caches, rows
        self._adapters, self.telemetry, self._cpu_pool = adapters, telemetry, cpu_pool
        self.cpu_prompt_tokens = cpu_prompt_tokens

    @property
    def tables(self) -> dict[int, ResidencyTable]:
        """The residency table of every device slot with a cache."""
        return {slot: cache.table for slot, cache in self.caches.items()}

    def rows_for(self, slot: int, phase: Phase = "decode") -> CachedExpertRows:
        """The ``ExpertRows`` the MoE layers computed on device slot ``slot`` call in ``phase``."""
        if (phase, slot) not in self._rows:
            raise ConfigError(f"device slot {slot} computes no layer in the {phase} phase")
        return self._rows[(phase, slot)]

    def _all_rows(self) -> list[CachedExpertRows]:
        return list(self._rows.values())

    def begin_window(self) -> None:
        """Enter a decode window: misses go over the link (``--pcie-frac``) or to the CPU."""
        for rows in self._all_rows():
            rows.decoding = True

    def use_gather(self, on: bool = True) -> None:
        """Switch the decode gather on (or off) for every device, whatever the automatic choice.

        ConfigError unless every arena layer is pinned (and Triton is there for a non-CPU device).
        """
        if on and not self.arena.all_pinned:
            raise ConfigError("the decode gather needs --arena pinned with every layer pinned "
                              "(no --pin-limit-gib cap)")
        if on and not HAS_TRITON and any(r.device.type != "cpu" for r in self._all_rows()):
            raise ConfigError("the decode gather on a GPU needs Triton")
        for rows in self._all_rows():
            rows.gather = on

    def use_grouped_prefill(self, on: bool = True) -> None:
        """Switch the grouped prefill (grouped.py) on (or off) for every device, whatever the
        automatic choice (on for CUDA devices)."""
        for rows in self._all_rows():
            rows.grouped = on

    def end_window(self, adapt: bool = True) -> dict[int, list[tuple[int, int]]]:
        """Leave the decode window and run ``--adapt-swaps`` adaptation (asynchronous copies; not
        after a failed window, ``adapt=False``); returns the experts swapped in per device slot."""
        for rows in self._all_rows():
            rows.decoding = False
            if rows.share.auto is not None:
                rows.share.auto.end_window(ok=adapt)
        if not adapt:
            return {}
        swapped = {slot: adapter.end_window() for slot, adapter in self._adapters.items()}
        return {slot: entries for slot, entries in swapped.items() if entries}

    def usages(self) -> list[UsageCounter]:
        """The routing counters, one per computing device slot."""
        return list({id(rows.usage): rows.usage for rows in self._all_rows()}.values())

    def usage_profile(self, model: str = "") -> UsageProfile:
        """Routing counts since load, summed over devices (what ``strata profile`` writes)."""
        profiles = [usage.profile(model) for usage in self.usages()]
        counts = torch.stack([p.counts for p in profiles]).sum(0)
        return UsageProfile(counts, max(p.tokens for p in profiles), model)

    def close(self) -> None:
        if self._cpu_pool is not None:
            self._cpu_pool.shutdown(wait=True)
        self._rows.clear()
        self.caches.clear()


def _fill_order(settings: StrataSettings, spec: ModelSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]] | None]:
    """(full fill order, the profile's routed experts or None without a profile)."""
    if settings.expert_profile is None:
        return default_order(spec.n_layers, spec.n_experts, spec.moe_layers), None
    profile = UsageProfile.load(settings.expert_profile, spec.n_layers, spec.n_experts)
    used = profile.rank(only_used=True, layers=spec.moe_layers)
    log.info("expert profile %s: %d of %d experts routed over %d tokens", settings.expert_profile,
             len(used), len(spec.moe_layers) * spec.n_experts, profile.tokens)
    return profile.rank(layers=spec.moe_layers), used


def _room(left: dict[torch.device, int], slots: dict[int, DeviceSlot], slot: int) -> int:
    """Memory for ``slot``'s cache: what its torch device has left, shared by the slots on it."""
    device = slots[slot].device
    sharing = sum(1 for other in slots.values() if other.device == device)
    return left[device] // sharing


def _chain(placement: Placement, phase: Phase, layer: int, caches: dict[int, ExpertCache],
           lanes: dict[tuple[int, ExpertSource], PeerLane]) -> Chain:
    """The expert sources of ``layer`` in ``phase`` resolved to caches (and the lanes of the peers
    that compute their rows, ``lanes`` by (computing slot, source))."""
    placed = placement.layers(phase)[layer]
    sources = placed.experts
    own = next((caches.get(s.device) for s in sources if s.kind == "cache"), None)
    peers = [s for s in sources if s.kind == "peer" and s.device in caches]
    kinds = {s.kind for s in sources}
    return Chain(own=own, peers=tuple(caches[s.device] for s in peers),
                 lanes=tuple(lanes[(placed.device, s)] for s in peers if s.compute),
                 link="arena" in kinds, cpu="cpu" in kinds)


def _lanes(placement: Placement, slots: dict[int, DeviceSlot], caches: dict[int, ExpertCache],
           copiers: dict[int, ArenaCopier], settings: StrataSettings,
           spec: ModelSpec) -> dict[tuple[int, ExpertSource], PeerLane]:
    """One lane per (computing slot, peer source that computes its rows) of the placement."""
    lanes: dict[tuple[int, ExpertSource], PeerLane] = {}
    for phase in PHASES:
        for placed in placement.layers(phase):
            for s in placed.experts:
                if s.kind == "peer" and s.compute and s.device in caches and (placed.device, s) not in lanes:
                    rows = s.rows or max(settings.prefill_chunk * spec.n_experts_used // 2, 1)
                    lanes[(placed.device, s)] = PeerLane(slots[placed.device].device, caches[s.device],
                                                         copiers[s.device], MissSplit(s.stream), rows,
                                                         str(slots[s.device]))
    return lanes


def _readers(placement: Placement, slot: int) -> list[int]:
    """The computing slots whose chains read ``slot``'s cache (in either phase), in index order."""
    return sorted({placed.device for phase in PHASES for placed in placement.layers(phase)
                   if any(s.cache_device == slot for s in placed.experts)})


def _cpu_pool(threads: int) -> ThreadPoolExecutor:
    """The worker computing a GPU's CPU share of decode misses with ``threads`` torch threads."""
    return ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts", initializer=torch.set_num_threads,
                              initargs=(threads,))


def _auto_split(slot: DeviceSlot, chains: dict[int, Chain], threads: int, start: float) -> AutoSplit | None:
    """``--pcie-frac auto``'s learned split of ``slot``'s decode layers whose misses may go both ways (None:
    no such layer), from link share ``start``; logged, with what it turns off."""
    layers = [layer for layer, chain in chains.items() if chain.link and chain.cpu]
    if not layers:
        return None
    log.info("pcie-frac auto: %s decodes with misses: each layer's misses are split between the host link and "
             "the CPU (%d threads), the split learned over the first %d decode windows; the decode gather and "
             "CUDA graphs are off on %s (they need --pcie-frac 1)", slot, threads, SETTLE_WINDOWS, slot)
    return AutoSplit(layers, name=str(slot), start=start)


def _slot_split(frac: float | None, slot: DeviceSlot, phase: Phase, chains: dict[int, Chain],
                threads: int, start: float) -> tuple[float | None, AutoSplit | None]:
    """The fixed link share of ``slot``'s decode misses in ``phase`` (``frac``, None: ``auto`` with misses),
    or None and the ``AutoSplit`` that learns it per layer from link share ``start``."""
    if frac is not None:
        return frac, None
    if slot.device.type == "cpu":
        return 0.0, None  # a CPU computes its misses where they lie
    auto = _auto_split(slot, chains, threads, start) if phase == "decode" else None
    return (None, auto) if auto is not None else (1.0, None)  # no layer splits: every miss over the link


def build_expert_backend(weights: ExpertWeights, spec: ModelSpec, placement: Placement, slots: dict[int, DeviceSlot],
                         settings: StrataSettings, dense_bytes_per_device: dict[torch.device, int],
                         progress: Callable[[float], None] | None = None) -> ExpertBackend:
    """Load the arena, size and fill each device slot's cache, and build its rows per phase.

    :param slots: the device slots by index: this process's (another rank's slots build nothing here).
    :param dense_bytes_per_device: bytes of everything else each torch device holds (dense weights,
        KV cache, prompt buffers), whether already allocated or not.
    :param progress: called with the fraction done (the arena is most of it, then each cache).
    """
    report = progress or (lambda fraction: None)
    torch_devices = {slots[i].device for i in placement.devices_used() if i in slots}
    dense = {d: dense_bytes_per_device.get(d, 0) for d in torch_devices}
    check_dense_budget(settings, dense)  # fails before the arena is loaded
    pin_limit = None if settings.pin_limit_gib is None else int(settings.pin_limit_gib * GIB)
    served = {slot: layers for slot, layers in placement.cached_layers().items() if slot in slots}
    own = {layer for phase in PHASES for layer, placed in enumerate(placement.layers(phase)) if placed.device in slots}
    arena = Arena(weights, spec.n_layers, spec.n_experts, settings.arena, pin_limit,
                  progress=lambda fraction: report(0.8 * fraction), layers=own.union(*served.values()))
    left = check_dense_budget(settings, dense)  # again: the arena may have taken host RAM
    order, used = _fill_order(settings, spec)
    telemetry = ExpertTelemetry()
    computing = {placed.device for phase in PHASES for placed in placement.layers(phase) if placed.device in slots}
    prompting = {placed.device for placed in placement.prompt}  # the others need no prompt buffers
    prompting |= {s.device for placed in placement.prompt for s in placed.experts if s.kind == "peer" and s.compute}
    copiers = {i: ArenaCopier(arena, slots[i].device, telemetry) for i in sorted(computing | set(served))}
    caches: dict[int, ExpertCache] = {}
    for slot in [*(s for s in placement.fill_order if s in served), *sorted(set(served) - set(placement.fill_order))]:
        layers = served[slot]
        mine = [(l, e) for l, e in order if l in layers and not any(c.table.holds(l, e) for c in caches.values())]
        ranked = None if used is None else sum(1 for l, e in used if l in layers and
                                                not any(c.table.holds(l, e) for c in caches.values()))
        room = _room(left, slots, slot)
        if slots[slot].device.type == "cuda" and slot in prompting:  # the grouped prefill's buffers
            room -= workspace_bytes(arena.slot_bytes, spec.expert_ffn_size, spec.hidden_size)
        n_slots = cache_slots(settings, slots[slot].device, arena.slot_bytes, len(mine), ranked, max(room, 0),
                              placement.budgets.get(slot))
        cache = ExpertCache(arena, copiers[slot], n_slots, name=str(slots[slot]))
        cache.fill(mine)
        caches[slot] = cache
        report(0.8 + 0.2 * len(caches) / len(served))
    held = torch.zeros(spec.n_layers, spec.n_experts, dtype=torch.bool)  # [L, E]: in some cache of this process
    for cache in caches.values():
        held |= cache.table.host >= 0
    frac = resolve_pcie_frac(settings.pcie_frac, {slots[s].device for s in computing}, arena.formats,
                             bool(held[sorted(own & set(spec.moe_layers))].all()))
    threads = settings.threads or torch.get_num_threads()  # the CPU share's torch threads
    cpu_pool = _cpu_pool(threads) if any(slots[s].device.type != "cpu" for s in computing) and frac != 1.0 else None
    start, cpu_tokens = START_FRAC, 0
    if cpu_pool is not None:  # a GPU with misses and a CPU share: auto's split and the short prompts' by the rates
        gpu = next(slots[s].device for s in sorted(computing) if slots[s].device.type != "cpu")
        layer = min(own & set(spec.moe_layers))
        rates = probe_rates(arena, layer, gpu, cpu_pool, spec.n_experts_used, compute_dtype(settings.dtype, gpu))
        if frac is None:  # auto: is the CPU worth a share?
            frac, start = probe_split(rates, str(gpu))
        cpu_tokens = decide_cpu_prompt_tokens(rates, start if frac is None else frac, spec.n_experts,
                                              spec.n_experts_used, settings.prefill_chunk, str(gpu))
        if frac == 1.0:
            cpu_pool.shutdown()
            cpu_pool = None
    rows: dict[tuple[Phase, int], CachedExpertRows] = {}
    lanes = _lanes(placement, slots, caches, copiers, settings, spec)
    usages: dict[int, UsageCounter] = {}
    for slot in sorted(computing):
        usage = usages[slot] = UsageCounter(spec.n_layers, spec.n_experts, slots[slot].device, spec.moe_layers[0])
        ring = StagingRing(copiers[slot])
        for phase in PHASES:
            layers = [l for l, placed in enumerate(placement.layers(phase)) if placed.device == slot]
            if not layers:
                continue
            chains = {l: _chain(placement, phase, l, caches, lanes) for l in layers}
            slot_frac, auto = _slot_split(frac, slots[slot], phase, chains, threads, start)
            share = MissShare(chains, arena, MissSplit(1.0 if slot_frac is None else slot_frac), cpu_pool, auto)
            rows[(phase, slot)] = CachedExpertRows(chains, ring, usage, telemetry, share, name=str(slots[slot]),
                                                   fused_expert_ffn=settings.fused_expert_ffn,
                                                   miss_read=settings.miss_read)
            rows[(phase, slot)].gather = (slots[slot].device.type == "cuda" and HAS_TRITON and arena.all_pinned
                                          and slot_frac == 1.0)
        if cpu_tokens and slots[slot].device.type != "cpu" and {("prompt", slot), ("decode", slot)} <= rows.keys():
            rows[("prompt", slot)].share.follow(cpu_tokens, rows[("decode", slot)].share)
    adapters: dict[int, Adapter] = {}
    for slot, cache in caches.items():
        swaps = placement.adapt_swaps.get(slot, settings.adapt_swaps)
        readers = [slot] if slot in usages else _readers(placement, slot)
        if swaps and readers:
            others = tuple(c for s, c in caches.items() if s != slot and served[s] & served[slot])
            adapters[slot] = Adapter(cache, usages[readers[0]], telemetry, swaps, others=others, layers=served[slot])
    telemetry.reset()  # the fill is not a request
    return ExpertBackend(arena, caches, rows, adapters, telemetry, cpu_pool, cpu_tokens)
