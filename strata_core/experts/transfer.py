"""Moving experts from the arena to a device: the copier and the double-buffered staging ring.

On CUDA every copy runs on the device's copy stream and the compute stream waits on events, so
the host only enqueues: ``StagingRing.run`` issues the copy of expert j+depth while expert j is
computed (``run_batches``: the copies of expert group j+depth while group j is), and a ring buffer
is refilled only after the compute that read it (an event, not a host wait). ``prefetch`` issues a
layer's first groups before its routing is known (the grouped prefill predicts them at the end of
the layer before, so they cross the link while the next layer's attention runs). Arena layers that
are not pinned go through a ring of pinned host buffers first (the one place the host may wait: for
the DMA that last read a host buffer, ``host_depth`` copies back).
On the CPU the same code runs with synchronous copies, so CI exercises every branch but the events.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from strata_core.experts.arena import Arena, can_pin
from strata_core.experts.telemetry import ExpertTelemetry

__all__ = ["ArenaCopier", "StagingRing", "copy_runs"]


def copy_runs(batch: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(row, expert, m)`` runs of ``batch``'s ``(row, expert)`` pairs: each covers ``m`` consecutive
    pairs whose rows and experts both count up by one, so one copy moves them (a layer's experts are
    consecutive rows of its arena buffer)."""
    runs: list[list[int]] = []
    for row, expert in batch:
        if runs and runs[-1][0] + runs[-1][2] == row and runs[-1][1] + runs[-1][2] == expert:
            runs[-1][2] += 1
        else:
            runs.append([row, expert, 1])
    return [(row, expert, m) for row, expert, m in runs]


class ArenaCopier:
    """Copies one packed expert from the arena into a device buffer on the device's copy stream."""

    def __init__(self, arena: Arena, device: torch.device, telemetry: ExpertTelemetry, host_depth: int = 4):
        self.arena, self.device, self.telemetry = arena, device, telemetry
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._host: list[torch.Tensor] = []
        self._host_done: list[torch.cuda.Event | None] = []
        self._next_host = 0
        if self.cuda:
            self._host = [torch.empty(arena.slot_bytes, dtype=torch.uint8, pin_memory=can_pin())
                          for _ in range(host_depth)]
            self._host_done = [None] * host_depth

    def copy_rows(self, layer: int, batch: Sequence[tuple[int, int]], dst: torch.Tensor) -> None:
        """Enqueue the copies of ``batch``'s ``(row, expert)``s of ``layer`` into those rows of ``dst``
        (``[R, >= packed]`` uint8 on the device). From a pinned layer on CUDA: one DMA per run of
        consecutive rows holding consecutive experts (:func:`copy_runs`) and one pair of timing events
        for the batch (the host's cost per copy is what bounds a prompt's misses), else ``copy`` each."""
        layer_buffer = self.arena.layer_buffer(layer) if self.cuda else None
        if layer_buffer is None or not batch:
            for row, expert in batch:
                self.copy(layer, expert, dst[row])
            return
        n = self.arena.formats[layer].total
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for row, expert, m in copy_runs(batch):
                dst[row:row + m, :n].copy_(layer_buffer[expert:expert + m], non_blocking=True)
            end.record()
        self.telemetry.add_copy_events(n * len(batch), start, end)

    def copy(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        """Enqueue the copy of (layer, expert) into ``dst`` (``[>= packed]`` uint8 on the device)."""
        n = self.arena.formats[layer].total
        if not self.cuda:
            t0 = time.perf_counter()
            self.arena.pack_into(layer, expert, dst)
            self.telemetry.add_copy(n, time.perf_counter() - t0)
            return
        src = self.arena.packed(layer, expert)
        host_slot = None
        if src is None:  # not pinned: host memcpy into a pinned staging buffer first
            host_slot = self._next_host
            self._next_host = (host_slot + 1) % len(self._host)
            if self._host_done[host_slot] is not None:
                self._host_done[host_slot].synchronize()  # the DMA that last read this host buffer
            src = self._host[host_slot][:n]
            self.arena.pack_into(layer, expert, src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            dst[:n].copy_(src, non_blocking=True)
            end.record()
        if host_slot is not None:
            self._host_done[host_slot] = end
        self.telemetry.add_copy_events(n, start, end)


class StagingRing:
    """``depth`` device buffers of ``rows`` experts each, cycling arena experts in front of compute
    (double-buffered at 2). One expert per buffer for the per-expert path (``run``), a whole expert
    group per buffer for the grouped prefill (``run_batches``)."""

    def __init__(self, copier: ArenaCopier, depth: int = 2, rows: int = 1):
        self.copier, self.depth = copier, depth
        dev = copier.device
        self.buffers = torch.empty((depth, rows, copier.arena.slot_bytes), dtype=torch.uint8, device=dev)  # [depth, R, B]
        self.cuda = copier.cuda
        if self.cuda:
            self._ready = [torch.cuda.Event() for _ in range(depth)]
            self._free = [torch.cuda.Event() for _ in range(depth)]
        self._prefetched: list[tuple[int, set[tuple[int, int]]] | None] = [None] * depth  # (layer, batch) held
        self._next = 0  # the buffer the next batch takes: the cycle goes on from one call to the next

    def prefetch(self, layer: int, batches: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Issue the copies of the first ``depth`` non-empty ``batches`` of ``layer`` now, before its routing is
        known (a prediction): the next ``run_batches`` of that layer skips the copy of each batch whose
        rows and experts a prefetched one covers, and copies the others again."""
        for i, batch in enumerate([batch for batch in batches if batch][:self.depth]):
            b = (self._next + i) % self.depth
            self._issue(layer, batch, b)
            self._prefetched[b] = (layer, set(batch))

    def run(self, layer: int, experts: Sequence[int], consume: Callable[[int, torch.Tensor], None]) -> None:
        """Stream ``experts`` of ``layer`` through the ring, calling ``consume(expert, packed)`` for each
        on the current (compute) stream once its bytes are there."""
        self.run_batches(layer, [[(0, e)] for e in experts], lambda j, buffer: consume(experts[j], buffer[0]))

    def run_batches(self, layer: int, batches: Sequence[Sequence[tuple[int, int]]],
                    consume: Callable[[int, torch.Tensor | None], None]) -> None:
        """Stream batch j's experts of ``layer`` (``(row, expert)`` pairs, rows < ``rows``) into the rows of
        one buffer and call ``consume(j, buffer [R, B])`` on the current (compute) stream once they are
        there; an empty batch takes no buffer (``consume(j, None)`` at once). The buffers cycle over
        the non-empty batches: the (n + depth)-th is copied while the n-th is consumed. The cycle goes on
        from the last call's, so a call's first copies take the buffers read longest ago (with one batch
        a layer, the next layer's copy does not wait for this layer's compute)."""
        copied = [j for j, batch in enumerate(batches) if batch]  # the batches that take a buffer, in order
        first = self._next
        for i, j in enumerate(copied[:self.depth]):
            b = (first + i) % self.depth
            held = self._prefetched[b]
            if held is None or held[0] != layer or not held[1].issuperset(batches[j]):
                self._issue(layer, batches[j], b)
        self._prefetched = [None] * self.depth
        self._next = (first + len(copied)) % self.depth
        n = 0  # batches[copied[n]] is the next to take a buffer
        for j, batch in enumerate(batches):
            if not batch:
                consume(j, None)
                continue
            b = (first + n) % self.depth
            if self.cuda:
                torch.cuda.current_stream(self.copier.device).wait_event(self._ready[b])
            consume(j, self.buffers[b])
            if self.cuda:
                self._free[b].record(torch.cuda.current_stream(self.copier.device))
            if n + self.depth < len(copied):
                self._issue(layer, batches[copied[n + self.depth]], b)
            n += 1

    def _issue(self, layer: int, batch: Sequence[tuple[int, int]], i: int) -> None:
        self._prefetched[i] = None
        if self.cuda:
            self.copier.stream.wait_event(self._free[i])  # compute is done reading buffer i
        self.copier.copy_rows(layer, batch, self.buffers[i])
        if self.cuda:
            self._ready[i].record(self.copier.stream)
