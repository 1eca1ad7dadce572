"""How much device memory the expert cache gets, and the budget checks made before loading.

Order of precedence for one device slot:

0. the placement's ``CacheBudget`` for the slot (slots, GiB, or auto with its own reserve), where
   the strategy gives one;
1. ``--expert-cache N``: N slots (at most one per expert the device serves);
2. ``--expert-cache-gib X``: as many slots as fit in X GiB;
3. ``auto``: free device memory minus the dense part (weights, KV, prompt buffers: what the
   engine passes as ``dense_bytes``) minus ``--reserve-mib``; with a profile, only the experts the
   profile saw routed unless ``--expert-cache-fill-all``.

On the CPU "device memory" is host RAM (``MemAvailable``), shared by the logical CPU devices.
``--vram-budget-gib`` caps what each device slot's memory counts as (a smaller card simulated on a
larger one): the dense part must fit in it, and the cache gets what is left of it.
"""

from __future__ import annotations

import torch

from strata_core.config import StrataSettings
from strata_core.errors import BudgetError
from strata_core.plugin.placement import CacheBudget

__all__ = ["available_bytes", "budget_bytes", "check_dense_budget", "cache_slots"]

MIB, GIB = 1 << 20, 1 << 30


def _host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise BudgetError("cannot read MemAvailable from /proc/meminfo")


def available_bytes(device: torch.device, n_sharing: int = 1, cap: int | None = None) -> int:
    """Memory the engine may use on ``device``: free now plus what torch already holds there
    (so the dense weights count the same whether they were loaded before this call or not), at most
    ``cap`` bytes."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        have = free + torch.cuda.memory_reserved(device)
    else:
        have = _host_available() // n_sharing
    return have if cap is None else min(have, cap)


def budget_bytes(settings: StrataSettings) -> int | None:
    """``--vram-budget-gib`` in bytes, None without one."""
    return None if settings.vram_budget_gib is None else int(settings.vram_budget_gib * GIB)


def check_dense_budget(settings: StrataSettings, dense_bytes: dict[torch.device, int],
                       kv_bytes: dict[torch.device, int] | None = None, kv_tokens: int = 0) -> dict[torch.device, int]:
    """Raise BudgetError if a device cannot hold its dense part plus ``--reserve-mib``; where the dense
    part includes the KV cache (``kv_bytes`` of it, for ``kv_tokens`` positions), the error says how much
    of it that is and what takes less.

    Call it before loading anything. Returns each device's memory left for the expert cache.
    """
    n_cpu = sum(1 for d in dense_bytes if d.type == "cpu") or 1
    cap = budget_bytes(settings)
    left: dict[torch.device, int] = {}
    for device, dense in dense_bytes.items():
        have = available_bytes(device, n_cpu if device.type == "cpu" else 1, cap)
        need = dense + settings.reserve_mib * MIB
        if need > have:
            within = f" within --vram-budget-gib {settings.vram_budget_gib:g}" if cap is not None and have == cap else ""
            kv = (kv_bytes or {}).get(device, 0)
            of_it = (f"; {kv / GIB:.2f} GiB of it is the KV cache of {kv_tokens} tokens (--kv-pool-tokens, default "
                     f"--parallel x --max-context; --kv-type {settings.kv_type}): a shorter --max-context, fewer "
                     "--parallel or a quantized --kv-type (int8, q8_0) takes less" if kv else "")
            raise BudgetError(f"{device}: the dense part needs {dense / GIB:.2f} GiB (+ {settings.reserve_mib} MiB "
                              f"reserve) but only {have / GIB:.2f} GiB is available{within}{of_it}")
        left[device] = have - need
    return left


def cache_slots(settings: StrataSettings, device: torch.device, slot_bytes: int, n_candidates: int,
                n_ranked: int | None, left_bytes: int, budget: CacheBudget | None = None) -> int:
    """Slots for ``device``'s cache.

    :param slot_bytes: bytes of one slot (the largest packed expert).
    :param n_candidates: experts this device could hold (its layers x experts).
    :param n_ranked: experts the profile saw routed on those layers (None without a profile).
    :param left_bytes: memory left after the dense part and the reserve (``check_dense_budget``).
    :param budget: the placement's budget for this slot, overriding the settings.
    """
    if budget is not None and budget.slots is not None:
        return min(budget.slots, n_candidates)
    if budget is None and isinstance(settings.expert_cache, int):
        return min(settings.expert_cache, n_candidates)
    fit = left_bytes // slot_bytes
    if budget is not None and budget.reserve_mib is not None:  # auto, with the slot's own reserve
        fit = max(left_bytes + (settings.reserve_mib - budget.reserve_mib) * MIB, 0) // slot_bytes
        budget = None
    gib, what = (budget.gib, "the strategy's cache budget") if budget is not None else (
        settings.expert_cache_gib, "--expert-cache-gib")
    if gib is not None:
        want = int(gib * GIB) // slot_bytes
        if want > fit:
            raise BudgetError(f"{device}: {what} {gib:g} (GiB) does not fit; "
                              f"{fit * slot_bytes / GIB:.2f} GiB is left after the dense part and the reserve")
        return min(want, n_candidates)
    if n_ranked is not None and not settings.expert_cache_fill_all:
        fit = min(fit, n_ranked)
    return min(fit, n_candidates)
