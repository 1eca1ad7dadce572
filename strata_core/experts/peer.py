"""Rows computed on a peer device slot (``ExpertSource.peer(d, compute=True)``): activations go over,
rows come back.

A :class:`PeerLane` joins a computing device slot (the *home*) to one peer whose cache its chains
read with ``compute=True``. Work for the peer is enqueued inside ``lane.enqueue()``: on CUDA it runs
on a side stream of the peer, after an event recorded on the home stream (the layer's routing), and
the rows come back on a side stream of the home device; the home stream waits for them only where
it combines them (``lane.join()``, an event), so the peer's rows overlap the home's own and nothing
waits on the host. On the CPU the same code runs in order, so CI runs every branch but the events.
Because only events order the work, a decode window with peers is captured as one CUDA graph with
the peer's kernels and copies in it (graphs.py); the peer's allocations inside a capture go to a
pool of the lane's own. (The decode rows of a peer are combined in the home's ``moe_decode`` launch
with the home's, in its fixed pair order: device_rows.py; the greedy tokens then equal ``single``'s.)

What the lane computes (``CachedExpertRows``, device_rows.py, drives it):

* decode (the decode gather): the pairs whose expert the peer holds go through the same pair kernel
  as the home's, from the peer's slots, and so do the missed pairs whose expert falls in the
  lane's ``stream`` share (``split.frac``), read from the arena over the peer's own host link; the
  pairs it does not serve point at its cache's zero slot (cache.py), and the home points the pairs
  the peer serves at its own zero slot, so no expert is read twice;
* prompts (the grouped prefill and the loop per expert): the rows of the experts the peer holds,
  and of ``stream`` (a share, ``split``) of the home's misses, streamed over the peer's own host link
  through its own staging ring; the rows go back in one copy once the home has read how many pairs
  were routed there. A long chunk's groups are planned from the residency and enqueued before that
  read (device_rows.py); a short chunk's are cut from the routing, in compact groups of at most
  ``rows`` (token, k) pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from strata_core.runtime.devices import device_scope
from strata_core.experts.split import MissSplit
from strata_core.experts.transfer import ArenaCopier, StagingRing

if TYPE_CHECKING:
    from strata_core.experts.cache import ExpertCache

__all__ = ["PeerLane", "packed_copy"]


class PeerLane:
    """A home device slot's way to one peer that computes rows: the peer's cache, its side streams,
    its share of the home's prompt misses and its compact-buffer size.

    :param home: the torch device of the computing slot.
    :param cache: the peer's cache.
    :param copier: the peer's arena copier (its own host link).
    :param split: the deterministic share of the home's misses the peer streams (``split.frac``).
    :param rows: the most (token, k) pairs of one compact prompt group on the peer (a short chunk's).
    :param name: the peer's device slot name (telemetry).
    """

    def __init__(self, home: torch.device, cache: ExpertCache, copier: ArenaCopier, split: MissSplit, rows: int,
                 name: str):
        self.home, self.cache, self.device = home, cache, cache.device
        self.copier, self.split, self.rows, self.name = copier, split, rows, name
        self._rings: dict[int, StagingRing] = {}
        cuda = home.type == "cuda" and self.device.type == "cuda"
        self._peer_stream = torch.cuda.Stream(self.device) if cuda else None
        self._home_stream = torch.cuda.Stream(home) if cuda else None
        self._done: list[torch.cuda.Event] = []
        self._held: list[torch.Tensor] = []
        self._outer: torch.cuda.Stream | None = None  # the home's stream when ``enqueue()`` was entered
        self._pool = None  # torch.cuda.MemPool of the peer's allocations inside graph captures

    def ring(self, rows: int = 1) -> StagingRing:
        """The peer's staging ring with ``rows`` experts per buffer (allocated on first use)."""
        if rows not in self._rings:
            self._rings[rows] = StagingRing(self.copier, rows=rows)
        return self._rings[rows]

    @contextmanager
    def enqueue(self, after: torch.cuda.Event | None = None, again: bool = False) -> Iterator[None]:
        """Enqueue the block's work for the peer after the home's work so far, or only after ``after`` (a
        ``mark()``: what the home enqueued since is not waited for, so the block must read nothing made
        since), on the side streams (CUDA; in order on the CPU). Copies to the peer inside run on the
        home's side stream, copies back on the peer's, and the home's side stream waits for them;
        ``join()`` makes the home's current stream wait for all of it. A lane is entered once per
        layer, then joined; ``again`` enters it once more before the join (the block runs after the
        first one's work on the side streams: e.g. rows copied back once the host knows how many)."""
        if self._peer_stream is None:
            with device_scope(self.device):
                yield
            return
        if not again:  # left by a layer that failed before its join (a failed capture's events)
            self._done.clear()
            self._held.clear()
        pool = self._captured()  # asked on the home stream, before the side streams join
        self._outer = torch.cuda.current_stream(self.home)
        ready = after if after is not None else self.mark()
        self._home_stream.wait_event(ready)
        self._peer_stream.wait_event(ready)
        with torch.cuda.stream(self._home_stream), torch.cuda.stream(self._peer_stream), pool:
            yield
        for stream in (self._home_stream, self._peer_stream):  # both: on cuda:0,cuda:0 they are one device
            done = torch.cuda.Event()
            done.record(stream)
            self._done.append(done)

    def mark(self) -> torch.cuda.Event | None:
        """An event of the home's work so far (e.g. a layer's routing), for ``enqueue(after=...)``; None off CUDA."""
        if self._peer_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.home))
        return event

    def _captured(self) -> contextlib.AbstractContextManager:
        """Inside a CUDA-graph capture of the home stream (graphs.py), the peer's allocations go to a
        pool this lane keeps for as long as it lives (the graph's own pool is the home device's); the
        home's side stream joins the capture, so its allocations are in the graph's pool already."""
        if self.device == self.home or not torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()
        if self._pool is None:
            with torch.cuda.device(self.device):  # a pool belongs to the device current at its creation
                self._pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self._pool, device=self.device)

    def hand_over(self) -> None:
        """Inside ``enqueue()``: make the home's own stream wait for the work enqueued in the block so far
        (a small result it reads before ``join()``, e.g. which pairs the peer serves). Without it a
        replayed graph has no edge from that work to its reader, which then reads the previous replay's
        result (a graphed peer tier's greedy text then leaves single's after a few tokens)."""
        if self._peer_stream is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.home))  # the side stream current for the home here
        self._outer.wait_event(done)

    def send(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """``tensors`` of the home on the peer (inside ``enqueue()``) through one copy
        (:func:`packed_copy`): each cross-device copy costs latency on the peer's path."""
        return list(tensors) if self.device == self.home else packed_copy(tensors, self.device)

    def hold(self, *tensors: torch.Tensor) -> None:
        """Keep tensors of the home's stream that the side streams read alive until ``join()`` (their
        memory must not be reused before the side streams have read it)."""
        self._held.extend(tensors)

    def join(self) -> None:
        """Make the home's current stream wait for everything enqueued for the peer (no host wait)."""
        self._held.clear()
        if self._done:
            current = torch.cuda.current_stream(self.home)
            for done in self._done:
                current.wait_event(done)
            self._done.clear()


def packed_copy(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one device) on ``device`` through one copy: their bytes packed into one
    buffer, each at a 16-byte-aligned offset, and views of that buffer's copy."""
    spans, end = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        spans.append((end, n))
        end += -(-n // 16) * 16
    packed = torch.empty(end, dtype=torch.uint8, device=tensors[0].device)
    for t, (start, n) in zip(tensors, spans):
        packed[start:start + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    there = packed.to(device)
    return [there[start:start + n].view(t.dtype).view(t.shape) for t, (start, n) in zip(tensors, spans)]
