"""Expert-path counters of one request: hit rate, bytes moved, link speed, copy vs compute time.

CUDA timings are pairs of events resolved only in ``snapshot()`` (once per request, never on
the compute path); CPU timings are wall-clock spans. Hits are counted on the device (a tensor
add, no host read) and read in ``snapshot()``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["ExpertTelemetry"]


class ExpertTelemetry:
    """Counters since the last ``reset()``; ``snapshot()`` is what the engine, server and bench read."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.routed = 0  # (token, top-k) pairs routed
        self._hits: dict[torch.device, torch.Tensor] = {}  # per device, a 0-d int64 on that device
        self.experts = {"resident": 0, "streamed": 0, "pcie": 0, "cpu": 0}  # (layer, expert) groups by source
        self.bytes_copied = 0
        self.swaps = 0
        self._copy_s = 0.0
        self._compute_s = 0.0
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # --- recording (called by the expert path) ---------------------------------------------------
    def add_routing(self, n_pairs: int, hits: torch.Tensor) -> None:
        """``hits``: 0-d tensor on the computing device, pairs whose expert was resident."""
        self.routed += n_pairs
        acc = self._hits.get(hits.device)
        self._hits[hits.device] = hits.to(torch.int64) if acc is None else acc + hits

    def add_copy(self, nbytes: int, seconds: float) -> None:
        self.bytes_copied += nbytes
        self._copy_s += seconds

    def add_copy_events(self, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.bytes_copied += nbytes
        self._events.append(("copy", start, end))

    @contextmanager
    def compute(self, device: torch.device) -> Iterator[None]:
        """Time the expert compute enqueued inside the block (events on CUDA, wall clock on CPU)."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append(("compute", start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._compute_s += time.perf_counter() - t0

    # --- reading -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float | int]:
        """Counters as plain numbers: hits/misses (routed pairs), experts by source, bytes streamed,
        copy and compute seconds, and the derived hit rate and link GB/s."""
        copy_s, compute_s = self._copy_s, self._compute_s
        for kind, start, end in self._events:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "copy":
                copy_s += seconds
            else:
                compute_s += seconds
        hits = sum(int(h) for h in self._hits.values())
        counters = {
            "expert_hits": hits,
            "expert_misses": self.routed - hits,
            **{f"experts_{k}": v for k, v in self.experts.items()},
            "bytes_streamed": self.bytes_copied,
            "copy_s": copy_s,
            "compute_s": compute_s,
            "swaps": self.swaps,
        }
        return _with_rates(counters)

    def delta(self, before: dict[str, float | int]) -> dict[str, float | int]:
        """Counters since ``before`` (an earlier ``snapshot()``), rates recomputed."""
        now = self.snapshot()
        return _with_rates({k: v - before.get(k, 0) for k, v in now.items() if k not in _RATES})


_RATES = ("hit_rate", "link_gbps")


def _with_rates(c: dict[str, float | int]) -> dict[str, float | int]:
    routed = c["expert_hits"] + c["expert_misses"]
    c["hit_rate"] = c["expert_hits"] / routed if routed else 1.0
    c["link_gbps"] = c["bytes_streamed"] / c["copy_s"] / 1e9 if c["copy_s"] > 0 else 0.0
    return c
