"""``build_expert_backend``: the arena, one cache + table per device, the rows the MoE layers call.

The engine calls, in order::

    left = check_dense_budget(settings, dense_bytes)       # before loading anything (BudgetError)
    backend = build_expert_backend(weights, spec, plan, settings, dense_bytes)
    rows = backend.rows_for(device)                        # ExpertRows of the layers on `device`
    backend.begin_window(); ... decode ...; backend.end_window()   # around each decode window
    backend.use_gather(True)                               # tests: force the decode gather on the CPU
    backend.use_grouped_prefill(True)                      # tests: force the grouped prefill on the CPU
    backend.telemetry.reset() / .snapshot()                # per request
    backend.close()

Which experts a device caches: the layers of its stages, all layers if it is the plan's
``prefill_device``, and for a tier the layers of the stage it serves minus what that stage's
device already holds. Devices are filled in plan order from the profile's rank order (or
``default_order``).

Decode windows take the decode gather (gather.py: no host read per layer) on a CUDA device when
Triton is installed, every arena layer is pinned and ``--pcie-frac`` is 1 (every miss over the
link); elsewhere (CPU, mmap or partly pinned arena, CPU share of misses) the loop per expert.
Prefill chunks take the grouped prefill (grouped.py) on a CUDA device and the loop per expert (the
bit-exact reference) on the CPU.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from strata_core.config import StrataSettings
from strata_core.experts.adapt import Adapter
from strata_core.experts.arena import GIB, Arena
from strata_core.experts.cache import ExpertCache
from strata_core.experts.device_rows import CachedExpertRows, MissSplit
from strata_core.experts.grouped import workspace_bytes
from strata_core.experts.profile import UsageCounter, UsageProfile, default_order
from strata_core.experts.rows import ExpertRows
from strata_core.experts.sizing import cache_slots, check_dense_budget
from strata_core.experts.table import ResidencyTable
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.experts.transfer import ArenaCopier, StagingRing
from strata_core.experts.weights import ExpertWeights
from strata_core.errors import ConfigError
from strata_core.gguf.spec import ModelSpec
from strata_core.ops.gather import HAS_TRITON
from strata_core.topology import TopologyPlan

__all__ = ["ExpertBackend", "build_expert_backend"]

log = logging.getLogger(__name__)


class ExpertBackend:
    """Everything expert-related the engine holds: arena, caches, tables, rows, telemetry."""

    def __init__(self, arena: Arena, caches: dict[torch.device, ExpertCache], rows: dict[torch.device, CachedExpertRows],
                 adapters: list[Adapter], telemetry: ExpertTelemetry, cpu_pool: ThreadPoolExecutor | None):
        self.arena, self.caches, self._rows = arena, caches, rows
        self._adapters, self.telemetry, self._cpu_pool = adapters, telemetry, cpu_pool

    @property
    def tables(self) -> dict[torch.device, ResidencyTable]:
        """The residency table of every device."""
        return {device: cache.table for device, cache in self.caches.items()}

    def rows_for(self, device: torch.device | str) -> ExpertRows:
        """The ``ExpertRows`` the MoE layers running on ``device`` call."""
        device = torch.device(device)
        if device not in self._rows:
            raise ConfigError(f"no expert cache on {device}; the plan has {', '.join(map(str, self._rows))}")
        return self._rows[device]

    def begin_window(self) -> None:
        """Enter a decode window: misses go over the link (``--pcie-frac``) or to the CPU."""
        for rows in self._rows.values():
            rows.decoding = True

    def use_gather(self, on: bool = True) -> None:
        """Switch the decode gather on (or off) for every device, whatever the automatic choice.

        ConfigError unless every arena layer is pinned (and Triton is there for a non-CPU device).
        """
        if on and not self.arena.all_pinned:
            raise ConfigError("the decode gather needs --arena pinned with every layer pinned "
                              "(no --pin-limit-gib cap)")
        if on and not HAS_TRITON and any(d.type != "cpu" for d in self._rows):
            raise ConfigError("the decode gather on a GPU needs Triton")
        for rows in self._rows.values():
            rows.gather = on

    def use_grouped_prefill(self, on: bool = True) -> None:
        """Switch the grouped prefill (grouped.py) on (or off) for every device, whatever the
        automatic choice (on for CUDA devices)."""
        for rows in self._rows.values():
            rows.grouped = on

    def end_window(self) -> None:
        """Leave the decode window and run ``--adapt-swaps`` adaptation (asynchronous copies)."""
        for rows in self._rows.values():
            rows.decoding = False
        for adapter in self._adapters:
            adapter.end_window()

    def usage_profile(self, model: str = "") -> UsageProfile:
        """Routing counts since load, summed over devices (what ``strata profile`` writes)."""
        profiles = [rows.usage.profile(model) for rows in self._rows.values()]
        counts = torch.stack([p.counts for p in profiles]).sum(0)
        return UsageProfile(counts, max(p.tokens for p in profiles), model)

    def close(self) -> None:
        if self._cpu_pool is not None:
            self._cpu_pool.shutdown(wait=True)
        self._rows.clear()
        self.caches.clear()


def _served_layers(plan: TopologyPlan, device: torch.device, n_layers: int) -> set[int]:
    if plan.prefill_device == device:
        return set(range(n_layers))
    layers = {l for stage in plan.stages if stage.device == device for l in stage.layers}
    for tier in plan.tiers:
        if tier.device == device:
            layers |= set(plan.stages[tier.stage].layers)
    return layers


def _fill_order(settings: StrataSettings, spec: ModelSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]] | None]:
    """(full fill order, the profile's routed experts or None without a profile)."""
    if settings.expert_profile is None:
        return default_order(spec.n_layers, spec.n_experts), None
    profile = UsageProfile.load(settings.expert_profile, spec.n_layers, spec.n_experts)
    used = profile.rank(only_used=True)
    log.info("expert profile %s: %d of %d experts routed over %d tokens", settings.expert_profile,
             len(used), spec.n_layers * spec.n_experts, profile.tokens)
    return profile.rank(), used


def build_expert_backend(weights: ExpertWeights, spec: ModelSpec, plan: TopologyPlan, settings: StrataSettings,
                         dense_bytes_per_device: dict[torch.device, int]) -> ExpertBackend:
    """Load the arena, size and fill each device's cache, and build its rows.

    :param dense_bytes_per_device: bytes of everything else each device holds (dense weights, KV
        cache, prompt buffers), whether already allocated or not.
    """
    dense = {d: dense_bytes_per_device.get(d, 0) for d in plan.devices}
    check_dense_budget(settings, dense)  # fails before the arena is loaded
    pin_limit = None if settings.pin_limit_gib is None else int(settings.pin_limit_gib * GIB)
    arena = Arena(weights, spec.n_layers, spec.n_experts, settings.arena, pin_limit)
    left = check_dense_budget(settings, dense)  # again: the arena may have taken host RAM
    order, used = _fill_order(settings, spec)
    telemetry = ExpertTelemetry()
    cpu_pool = (ThreadPoolExecutor(1, thread_name_prefix="strata-cpu-experts")
                if any(d.type != "cpu" for d in plan.devices) and settings.pcie_frac < 1 else None)
    caches: dict[torch.device, ExpertCache] = {}
    rows: dict[torch.device, CachedExpertRows] = {}
    adapters: list[Adapter] = []
    for device in plan.devices:
        layers = _served_layers(plan, device, spec.n_layers)
        held = {(l, e) for c in caches.values() for l, e in c.table.resident() if l in layers}
        mine = [(l, e) for l, e in order if l in layers and (l, e) not in held]
        ranked = None if used is None else sum(1 for l, e in used if l in layers and (l, e) not in held)
        room = left[device]
        if device.type == "cuda":  # the grouped prefill path's ring and dequantize buffers
            room -= workspace_bytes(arena.slot_bytes, spec.expert_ffn_size, spec.hidden_size)
        n_slots = cache_slots(settings, device, arena.slot_bytes, len(mine), ranked, max(room, 0))
        copier = ArenaCopier(arena, device, telemetry)
        cache = ExpertCache(arena, copier, n_slots)
        cache.fill(mine)
        caches[device] = cache
        usage = UsageCounter(spec.n_layers, spec.n_experts, device)
        rows[device] = CachedExpertRows(cache, StagingRing(copier), usage, telemetry,
                                        MissSplit(settings.pcie_frac), cpu_pool)
        rows[device].gather = (device.type == "cuda" and HAS_TRITON and arena.all_pinned
                               and settings.pcie_frac == 1.0)
        if settings.adapt_swaps:
            adapters.append(Adapter(cache, usage, telemetry, settings.adapt_swaps))
    telemetry.reset()  # the fill is not a request
    return ExpertBackend(arena, caches, rows, adapters, telemetry, cpu_pool)
