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
        """Counters as plain numbers: hit rate, bytes, link GB/s, copy and compute seconds."""
        copy_s, compute_s = self._copy_s, self._compute_s
        for kind, start, end in self._events:
            end.synchronize()
            ms = start.elapsed_time(end) / 1e3
            copy_s, compute_s = (copy_s + ms, compute_s) if kind == "copy" else (copy_s, compute_s + ms)
        hits = sum(int(h) for h in self._hits.values())
        return {
            "routed": self.routed,
            "hits": hits,
            "hit_rate": hits / self.routed if self.routed else 1.0,
            **{f"experts_{k}": v for k, v in self.experts.items()},
            "bytes_streamed": self.bytes_copied,
            "copy_s": copy_s,
            "compute_s": compute_s,
            "link_gbps": self.bytes_copied / copy_s / 1e9 if copy_s > 0 else 0.0,
            "swaps": self.swaps,
        }
