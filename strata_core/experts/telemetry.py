"""Expert-path counters of one request: hit rate, bytes moved, link speed, copy vs compute time.

CUDA timings are pairs of events resolved only in ``snapshot()`` (never on the compute path), each
once: its seconds are added to the totals and the pair dropped; CPU timings are wall-clock spans. Counters known only on the device (hits;
everything the decode gather counts) are accumulated there (``add_counts``, or a kernel adding into
``accumulator()``: no host read) and read in ``snapshot()``.

CUDA-graph capture (graphs.py) runs the decode under ``capturing(sink)``: ``timed()`` records no
events there (a graph replays its work without the Python that would append event pairs, and timing
events are not capture-safe), and the counters accumulate into tensors of ``sink`` that the graph
owns (made, zeroed, inside the capture), so each replay recomputes one window's counts; the graph
runner folds them in after each replay. Outside ``capturing`` nothing changes.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Iterator

import torch

from strata_core.runtime.devices import timed_span

__all__ = ["ExpertTelemetry"]


class ExpertTelemetry:
    """Counters since the last ``reset()``; ``snapshot()`` is what the engine, server and bench read."""

    def __init__(self) -> None:
        self._sink: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] | None = None
        self.reset()

    def reset(self) -> None:
        self.routed = 0  # (token, top-k) pairs routed
        self._host_hits = 0  # routed pairs whose expert was resident, where the host knows it (``add_hits``)
        # (counter names, device) -> int64 [len(names)] accumulated on that device
        self._device: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
        # (layer, expert) groups by source, in all and per device slot
        self.experts = {"resident": 0, "peer": 0, "streamed": 0, "pcie": 0, "cpu": 0}
        self._by_device: dict[str, dict[str, int]] = {}
        self.bytes_copied = 0
        self.expert_bytes = 0  # blocks of the routed experts the loop per expert computed
        self.swaps = 0
        self._seconds = {"copy": 0.0, "compute": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # --- recording (called by the expert path) ---------------------------------------------------
    def add_routing(self, n_pairs: int, hits: torch.Tensor) -> None:
        """``hits``: 0-d tensor on the computing device, pairs whose expert was resident."""
        self.routed += n_pairs
        self.add_counts(("expert_hits",), hits.reshape(1))

    def add_hits(self, n_pairs: int, hits: int) -> None:
        """``add_routing`` where the host knows the hits (a layer held whole: every pair)."""
        self.routed += n_pairs
        self._host_hits += hits

    def count(self, device: str, by_source: dict[str, int]) -> None:
        """Add the (layer, expert) groups one layer served on device slot ``device``, by source."""
        per_device = self._by_device.setdefault(device, dict.fromkeys(self.experts, 0))
        for source, n in by_source.items():
            self.experts[source] += n
            per_device[source] += n

    def add_expert_bytes(self, nbytes: int) -> None:
        """Add the bytes of expert blocks one layer computed (read once each, wherever they were)."""
        self.expert_bytes += nbytes

    def by_device(self) -> dict[str, dict[str, int]]:
        """The expert groups served per device slot, by source, since ``reset()`` (host counters)."""
        return {device: dict(counts) for device, counts in self._by_device.items()}

    def add_counts(self, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Add ``values [len(names)]`` (integers on the computing device) to the counters ``names``
        (``expert_hits``, ``experts_<source>``, ``bytes_streamed``); no host read until ``snapshot()``."""
        self.accumulator(names, values.device).add_(values)

    def accumulator(self, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """The int64 ``[len(names)]`` tensor on ``device`` that device code adds the counters ``names`` to,
        in place (a kernel may add to it directly); inside ``capturing`` one the graph owns, zeroed at
        the start of each replay."""
        key = (names, device)
        held = self._sink if self._sink is not None else self._device
        if key not in held:
            held[key] = torch.zeros(len(names), dtype=torch.int64, device=device)
        return held[key]

    def add_copy(self, nbytes: int, seconds: float) -> None:
        self.bytes_copied += nbytes
        self._seconds["copy"] += seconds

    def add_copy_events(self, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.bytes_copied += nbytes
        self._events.append(("copy", start, end))

    def timed(self, kind: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """Time the work of ``kind`` ("copy" or "compute") enqueued inside the block (events on
        CUDA, wall clock on CPU); nothing inside ``capturing``."""
        if self._sink is not None:
            return contextlib.nullcontext()
        return timed_span(device, lambda start, end: self._events.append((kind, start, end)),
                          lambda seconds: self._seconds.update({kind: self._seconds[kind] + seconds}))

    def compute(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """Time the expert compute enqueued inside the block."""
        return self.timed("compute", device)

    @contextmanager
    def capturing(self, sink: dict[tuple[tuple[str, ...], torch.device], torch.Tensor]) -> Iterator[None]:
        """Inside the block the counters accumulate into ``sink`` (its tensors made inside the block) and
        ``timed()`` records nothing: the mode of a CUDA-graph capture and its warm-up."""
        previous, self._sink = self._sink, sink
        try:
            yield
        finally:
            self._sink = previous

    # --- reading -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float | int]:
        """Counters as plain numbers: hits/misses (routed pairs), experts by source, bytes streamed,
        expert bytes computed, copy and compute seconds, and the derived hit rate, link GB/s and expert GB/s
        (expert bytes a second of expert compute)."""
        for kind, start, end in self._events:  # resolved once, then folded in: a long-lived reader (the
            end.synchronize()  # server reads after every step) pays for the new events only
            self._seconds[kind] += start.elapsed_time(end) / 1e3
        self._events.clear()
        seconds = self._seconds
        device: dict[str, int] = {}
        for (names, _), acc in self._device.items():
            for name, value in zip(names, acc.tolist()):
                device[name] = device.get(name, 0) + value
        hits = device.get("expert_hits", 0) + self._host_hits
        counters = {
            "expert_hits": hits,
            "expert_misses": self.routed - hits,
            **{f"experts_{k}": v + device.get(f"experts_{k}", 0) for k, v in self.experts.items()},
            "bytes_streamed": self.bytes_copied + device.get("bytes_streamed", 0),
            "expert_bytes": self.expert_bytes,
            "copy_s": seconds["copy"],
            "compute_s": seconds["compute"],
            "swaps": self.swaps,
        }
        return _with_rates(counters)

    def delta(self, before: dict[str, float | int]) -> dict[str, float | int]:
        """Counters since ``before`` (an earlier ``snapshot()``), rates recomputed."""
        now = self.snapshot()
        return _with_rates({k: v - before.get(k, 0) for k, v in now.items() if k not in _RATES})


_RATES = ("hit_rate", "link_gbps", "expert_gbps")


def _with_rates(c: dict[str, float | int]) -> dict[str, float | int]:
    routed = c["expert_hits"] + c["expert_misses"]
    c["hit_rate"] = c["expert_hits"] / routed if routed else 1.0
    c["link_gbps"] = c["bytes_streamed"] / c["copy_s"] / 1e9 if c["copy_s"] > 0 else 0.0
    c["expert_gbps"] = c["expert_bytes"] / c["compute_s"] / 1e9 if c["compute_s"] > 0 else 0.0
    return c
