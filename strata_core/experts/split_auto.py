"""``--pcie-frac auto``: ``resolve_pcie_frac`` picks a fixed split where the answer is known, and
``AutoSplit`` learns one per MoE layer where it is not (a GPU decoding with misses).

A decode layer's misses go two ways at once: a share over the host link (copied, computed on the GPU)
and the rest computed on the CPU pool from the arena; the layer waits for the slower. ``AutoSplit``
times both shares in the first decode windows, per expert, and gives the link the share of its speed,
``c / (l + c)`` for ``l`` and ``c`` the seconds an expert takes over the link and on the CPU, so both
finish together. The first window is a warm-up (its timings are dropped); after ``SETTLE_WINDOWS``
windows the split is fixed, logged once, and nothing is timed any more. Which misses go where never
changes which rows are computed: every miss is computed exactly once, on one side or the other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from strata_core.experts.split import MissSplit
from strata_core.ops.cpu_kernels import has_cpu_kernel

if TYPE_CHECKING:
    from strata_core.experts.arena import ExpertFormat

__all__ = ["SETTLE_WINDOWS", "AutoSplit", "resolve_pcie_frac"]

log = logging.getLogger(__name__)

#: decode windows (the warm-up included) after which a learned split is fixed
SETTLE_WINDOWS = 8
#: the link share a layer starts from, before anything is measured (both sides get misses to time)
START_FRAC = 0.5
R = TypeVar("R")


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
        elif device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((layer, n_experts, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._add(self._link[layer], n_experts, time.perf_counter() - t0)

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
