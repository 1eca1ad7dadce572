"""``--pcie-frac auto``: ``resolve_pcie_frac`` picks a fixed split where the answer is known, and
``AutoSplit`` learns one per MoE layer where it is not (a GPU decoding with misses).

A decode layer's misses go two ways at once: a share over the host link (copied, computed on the GPU)
and the rest computed on the CPU pool from the arena; the layer waits for the slower. ``AutoSplit``
times both shares in the first decode windows, per expert, and gives the link the share of its speed,
``c / (l + c)`` for ``l`` and ``c`` the seconds an expert takes over the link and on the CPU, so both
finish together. The first window is a warm-up (its timings are dropped); after ``SETTLE_WINDOWS``
windows the split is fixed, logged once, and nothing is timed any more. Which misses go where never
changes which rows are computed: every miss is computed exactly once, on one side or the other.

Before any of that, ``measure_rates`` times one decode token's misses of a layer both ways on the
running host (the CPU kernels on the pool's worker, also at ``PROBE_ROWS`` rows an expert as a short
prompt chunk gives them, and the packed bytes over the link), and ``split_from_rates`` keeps every
miss on the link where the CPU's share would be below ``MIN_CPU_SHARE``: a split turns the decode
gather and CUDA graphs off, which a small CPU share does not pay for (on an H100 host the CPU computed
a token's misses at ~4 GB/s against the link's ~55 GB/s, and a learned split decoded at a tenth of the
link's speed). The same rates decide how short a prompt chunk must be to split its misses as the
decode does (prompt_split.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from strata_core.ops.cpu_kernels import has_cpu_kernel  # before experts.cpu_ffn, which the ops package imports
from strata_core.experts.cpu_ffn import cpu_experts_ffn
from strata_core.experts.ffn import SILU
from strata_core.experts.split import MissSplit
from strata_core.runtime.devices import synchronize, timed_span

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from strata_core.experts.arena import Arena, ExpertFormat

__all__ = ["MIN_CPU_SHARE", "PROBE_ROWS", "SETTLE_WINDOWS", "AutoSplit", "Rates", "measure_rates", "probe_rates",
           "probe_split", "resolve_pcie_frac", "split_from_rates"]

log = logging.getLogger(__name__)

#: decode windows (the warm-up included) after which a learned split is fixed
SETTLE_WINDOWS = 8
#: the link share a layer starts from, before anything is measured (both sides get misses to time)
START_FRAC = 0.5
#: the least share of a layer's misses the CPU must be able to take (by the measured rates) for a split
#: to be learned: below it every miss goes over the link, with the decode gather and CUDA graphs
MIN_CPU_SHARE = 0.15
#: rows an expert the probe also times the CPU at: a short prompt chunk's (two of the CPU kernels' 8-row tiles)
PROBE_ROWS = 16
R = TypeVar("R")


@dataclass(frozen=True)
class Rates:
    """What ``measure_rates`` measured of a layer's misses, in GB/s of their packed bytes: computed on the
    CPU pool at one row an expert (``cpu``: a decode token's share) and at ``PROBE_ROWS`` rows an expert
    (``cpu_rows``: the same bytes over the longer time those rows take), and copied over the link (``link``)."""

    cpu: float
    link: float
    cpu_rows: float


def resolve_pcie_frac(setting: float | str, devices: Collection[torch.device],
                      formats: Sequence[ExpertFormat | None], all_resident: bool) -> float | None:
    """The fixed share of decode misses over the host link that ``--pcie-frac`` means here, or None
    where ``AutoSplit`` learns it: a number is itself; ``auto`` is 0 where every computing device is the
    CPU (a miss is computed where it lies, not copied first), 1 where every expert is resident (no
    misses) or the CPU kernels do not cover some layer's formats, else None (a GPU with misses)."""
    if setting != "auto":
        return float(setting)
    if all(device.type == "cpu" for device in devices):
        return _chosen(0.0, "every computing device is the CPU: a miss is computed where it lies")
    if all_resident:
        return _chosen(1.0, "every expert is resident: no misses to split")
    if not all(has_cpu_kernel(f.qtypes, f.shapes) for f in formats if f is not None):
        return _chosen(1.0, "the CPU kernels do not cover every layer's expert formats: misses go over the host link")
    return None


def measure_rates(arena: Arena, layer: int, device: torch.device, pool: Executor, experts: int,
                  dtype: torch.dtype, repeats: int = 3) -> Rates:
    """The ``Rates`` of ``experts`` misses of ``layer``: the CPU kernels on ``pool``'s worker at one row an
    expert (as a decode layer's CPU share runs) and at ``PROBE_ROWS`` rows (a short prompt chunk's), and
    their packed bytes copied from the arena to ``device`` (pinned host memory over the link; a plain copy
    for a CPU device). Each is timed over ``repeats`` runs after one unmeasured run."""
    fmt = arena.formats[layer]
    ids = list(range(min(experts, arena.n_experts)))
    parts = [arena.parts(layer, e) for e in ids]

    def cpu_runs(rows: int) -> float:
        x = torch.randn(rows * len(ids), fmt.shapes[0][1]).to(dtype)  # [k * rows, H]
        cpu_experts_ffn(x, parts, [rows] * len(ids), fmt.qtypes, fmt.shapes, SILU, ids)
        t0 = time.perf_counter()
        for _ in range(repeats):
            cpu_experts_ffn(x, parts, [rows] * len(ids), fmt.qtypes, fmt.shapes, SILU, ids)
        return time.perf_counter() - t0

    cpu_s = pool.submit(cpu_runs, 1).result()
    rows_s = pool.submit(cpu_runs, PROBE_ROWS).result()
    sources = [torch.cat([p.reshape(-1) for p in part]) for part in parts]
    if device.type == "cuda":
        sources = [src.pin_memory() for src in sources]
    dst = torch.empty(sum(src.numel() for src in sources), dtype=torch.uint8, device=device)

    def copy() -> None:
        for chunk, src in zip(dst.split([src.numel() for src in sources]), sources):
            chunk.copy_(src, non_blocking=True)
        synchronize(device)

    copy()
    t0 = time.perf_counter()
    for _ in range(repeats):
        copy()
    link_s = time.perf_counter() - t0
    nbytes = repeats * dst.numel()
    return Rates(cpu=_gbps(nbytes, cpu_s), link=_gbps(nbytes, link_s), cpu_rows=_gbps(nbytes, rows_s))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def split_from_rates(cpu_gbps: float, link_gbps: float, where: str = "") -> float | None:
    """The link share a layer's misses start from by the measured rates, the CPU taking the share of its
    speed; 1.0 (every miss over the link, logged) where that CPU share is below ``MIN_CPU_SHARE``."""
    cpu_share = cpu_gbps / (cpu_gbps + link_gbps) if cpu_gbps + link_gbps > 0 else 0.0
    if cpu_share < MIN_CPU_SHARE:
        return _chosen(1.0, f"{where + ': ' if where else ''}the CPU computes misses at {cpu_gbps:.1f} GB/s, the "
                            f"link moves them at {link_gbps:.1f} GB/s: a CPU share of {cpu_share:.0%} does not pay "
                            "for the decode gather and CUDA graphs a split turns off")
    log.info("pcie-frac auto%s: CPU %.1f GB/s, link %.1f GB/s: the split starts at a link share of %.2f",
             f" on {where}" if where else "", cpu_gbps, link_gbps, 1.0 - cpu_share)
    return None


def probe_rates(arena: Arena, layer: int, device: torch.device, pool: Executor, experts: int,
                dtype: torch.dtype) -> Rates | None:
    """``measure_rates`` of a GPU with misses and a CPU share, or None (logged) where the CPU kernels do not
    cover ``layer``'s formats (the reference is no contender) or the probe fails: the split is an
    optimisation, not worth a failed load."""
    fmt = arena.formats[layer]
    if not has_cpu_kernel(fmt.qtypes, fmt.shapes):
        log.info("pcie-frac: no rate probe on %s: the CPU kernels do not cover layer %d's expert formats", device,
                 layer)
        return None
    try:
        return measure_rates(arena, layer, device, pool, experts, dtype)
    except Exception as exc:  # noqa: BLE001 - whatever stops the probe, the link alone still computes
        log.warning("pcie-frac: the CPU and link rates could not be measured on %s (%s: %s)", device,
                    type(exc).__name__, exc)
        return None


def probe_split(rates: Rates | None, where: str) -> tuple[float | None, float]:
    """``(frac, start)`` for a GPU with misses under ``auto``: ``split_from_rates`` of the probe's ``rates``
    (1.0, or None and the measured link share ``start`` a learned split begins from); 1.0 where the rates
    are unknown (logged)."""
    if rates is None:
        return _chosen(1.0, f"{where}: the rates are unknown: every miss goes over the link"), START_FRAC
    frac = split_from_rates(rates.cpu, rates.link, where)
    return frac, (START_FRAC if frac is not None else 1.0 - rates.cpu / (rates.cpu + rates.link))


def _chosen(frac: float, why: str) -> float:
    log.info("pcie-frac auto: %g (%s)", frac, why)
    return frac


@dataclass
class _Share:
    """Seconds and experts one side of a layer's split took, summed over the measured windows."""

    seconds: float = 0.0
    experts: int = 0

    def per_expert(self) -> float | None:
        return self.seconds / self.experts if self.experts else None


class AutoSplit:
    """Per MoE layer, the share of decode misses over the host link, learned from the time each side
    takes (see the module docstring); ``split(layer)`` is the layer's ``MissSplit``."""

    def __init__(self, layers: Iterable[int], name: str = "", windows: int = SETTLE_WINDOWS,
                 start: float = START_FRAC):
        if windows < 2:
            raise ValueError(f"AutoSplit: windows must be at least 2 (a warm-up and a measured one), not {windows}")
        self.name, self.windows = name, windows
        self._splits = {layer: MissSplit(start) for layer in layers}
        self._link = {layer: _Share() for layer in self._splits}
        self._cpu = {layer: _Share() for layer in self._splits}
        self._events: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []  # link timings on CUDA
        self._window = 0  # decode windows ended so far
        self.learning = True

    def split(self, layer: int) -> MissSplit:
        """The split of ``layer``'s decode misses (its ``frac`` moves while learning)."""
        return self._splits[layer]

    def fracs(self) -> dict[int, float]:
        """The link share of every layer now."""
        return {layer: split.frac for layer, split in self._splits.items()}

    @contextmanager
    def link(self, layer: int, n_experts: int, device: torch.device) -> Iterator[None]:
        """Time the work of ``layer``'s ``n_experts`` link misses enqueued inside the block (CUDA events,
        resolved at the window's end; wall clock on the CPU); nothing once settled or without misses."""
        if not self.learning or n_experts == 0:
            yield
            return
        with timed_span(device, lambda start, end: self._events.append((layer, n_experts, start, end)),
                        lambda seconds: self._add(self._link[layer], n_experts, seconds), time.perf_counter):
            yield

    def cpu_job(self, layer: int, n_experts: int, fn: Callable[..., R]) -> Callable[..., R]:
        """``fn`` timed where it runs (the CPU pool's worker) as ``layer``'s CPU share of ``n_experts``
        misses; ``fn`` itself once settled."""
        if not self.learning or n_experts == 0:
            return fn
        share = self._cpu[layer]

        def timed(*args: object) -> R:
            t0 = time.perf_counter()
            out = fn(*args)
            self._add(share, n_experts, time.perf_counter() - t0)
            return out

        return timed

    def _add(self, share: _Share, n_experts: int, seconds: float) -> None:
        if self._window > 0:  # the first window warms up (kernels compiled, pages touched): not measured
            share.seconds += seconds
            share.experts += n_experts

    def end_window(self, ok: bool = True) -> None:
        """Fold the window's timings in (``ok=False``: a failed window's are dropped), set each layer's
        share to balance its two sides, and after ``windows`` windows fix them and log the split."""
        if not self.learning:
            return
        events, self._events = self._events, []
        if ok:
            for layer, n, start, end in events:
                end.synchronize()
                self._add(self._link[layer], n, start.elapsed_time(end) / 1e3)
            self._window += 1
        for layer, split in self._splits.items():
            link, cpu = self._link[layer].per_expert(), self._cpu[layer].per_expert()
            if link is not None and cpu is not None and link + cpu > 0:
                split.frac = cpu / (link + cpu)  # share of the misses ∝ the side's speed
        if self._window >= self.windows:
            self.learning = False
            fracs = self.fracs()
            mean = sum(fracs.values()) / max(len(fracs), 1)
            log.info("pcie-frac auto on %s: link share per layer %s (mean %.2f, after %d decode windows)",
                     self.name, " ".join(f"{layer}:{frac:.2f}" for layer, frac in fracs.items()), mean, self._window)
