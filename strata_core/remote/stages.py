"""Segments on other ranks: rank 0 sends them (:class:`RemoteStages`), the other ranks run them
(:func:`serve_stages`).

Consecutive segments on other ranks run as one chain: the hidden state goes from rank to rank and
only the last answers rank 0. A hop's header names its segments (device slot, layers), the phase,
each row's session id and the positions it holds before the step, the chunk lengths (prompt) or row
offsets (decode), and the ids of sessions released since. The other rank keeps a mirror session
per (session id, segment) holding that segment's KV: a mirror longer than rank 0's session is cut
back to it (a request reusing a slot's prefix, rejected drafts, a step that failed after this rank
ran), one shorter is an error (prefix sharing and the conversation cache, which hold positions no
step brought, are off across ranks). A hand-off between a prompt segment on rank 0 and a decode
segment on another rank (prefill_main) moves the session's rows of that segment into its mirror and
back (kvtransfer's ``leave`` on one side, ``arrive`` on the other), all its positions each time.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from strata_core.config import StrataSettings
from strata_core.errors import StrataError
from strata_core.model import kvtransfer
from strata_core.model.kvcache import KVCache
from strata_core.plugin.placement import DeviceSlot, Phase, Segment
from strata_core.remote.group import Cluster, chain_links
from strata_core.remote.launch import Launch
from strata_core.runtime.session import UNSET, DecodeBatch, PromptBatch, Session

if TYPE_CHECKING:
    from strata_core.engine import Engine

__all__ = ["RemoteStages", "StageServer", "serve_stages"]

log = logging.getLogger(__name__)


class MirrorError(StrataError):
    """A rank holds fewer positions of a session than rank 0 says it has."""


class RemoteStages:
    """Rank 0's side: segments whose device slots are other ranks', run by sending the step there.

    :param segments: per phase, the segments of the placement (to name each rank's layers in errors).
    """

    def __init__(self, cluster: Cluster, devices: tuple[DeviceSlot, ...], segments: dict[Phase, tuple[Segment, ...]]
                 ) -> None:
        self.cluster = cluster
        self._devices = devices
        self._held: dict[int, dict[int, weakref.ref[Session]]] = {}  # rank -> session id -> the session
        for rank in range(1, cluster.world):
            ranges = sorted({(s.layers.start, s.layers.stop - 1) for phase in segments.values() for s in phase
                             if devices[s.device].rank == rank})
            slots = ", ".join(str(d) for d in devices if d.rank == rank)
            cluster.name(rank, f"{slots}, layers " + ", ".join(f"{a}..{b}" for a, b in ranges))

    def remote(self, segment: Segment) -> bool:
        """Whether ``segment`` runs on another rank."""
        return self._devices[segment.device].rank != self.cluster.rank

    def ready(self) -> None:
        """Wait for every rank to have loaded its layers, then start the heartbeat."""
        self.cluster.wait_ready()

    def run(self, phase: Phase, segments: Sequence[Segment], hidden: torch.Tensor,
            batch: PromptBatch | DecodeBatch) -> torch.Tensor:
        """``hidden [T, H]`` through consecutive ``segments`` on other ranks: one hop a rank (its
        consecutive segments in one), each rank's output sent straight to the next; the last one's on
        ``hidden``'s device."""
        hops: list[tuple[int, dict[str, Any]]] = []
        ends: list[tuple[torch.device, torch.device]] = []  # each hop's input and output device
        for segment in segments:
            slot = self._devices[segment.device]
            if hops and hops[-1][0] == slot.rank:
                hops[-1][1]["segments"].append(_named(segment))
                ends[-1] = (ends[-1][0], slot.device)
            else:
                hops.append((slot.rank, self._header(slot.rank, phase, segment, hidden, batch)))
                ends.append((slot.device, slot.device))
        return self.cluster.exchange(hops, hidden, chain_links(ends, hidden.device)).to(hidden.device)

    def hand_off(self, session: Session, layers: range, src: DeviceSlot, dst: DeviceSlot) -> None:
        """Move ``session``'s state of ``layers`` (a whole decode segment of another rank) between this
        rank and that one: from here it leaves this cache and arrives in the other rank's mirror of the
        segment; from there it leaves the mirror and arrives here. A hand-off that fails on the way out
        puts the rows back here."""
        if src.rank == self.cluster.rank:
            rows = kvtransfer.leave(session.kv, layers, dst.index)
            try:
                self.cluster.request(dst.rank, self._message(dst.rank, "arrive", session, dst, layers)
                                     | {"rows": (rows.n_tokens, rows.tensors)})
            except BaseException:
                kvtransfer.arrive(session.kv, rows, src.index, src.device)
                raise
        else:
            n_tokens, tensors = self.cluster.request(src.rank, self._message(src.rank, "leave", session, src, layers)
                                                     | {"to": dst.index})
            kvtransfer.arrive(session.kv, kvtransfer.KVSnapshot(n_tokens, tensors), dst.index, dst.device)

    def resident(self) -> set[tuple[int, int]]:
        """The (layer, expert) entries the other ranks' caches hold."""
        return set().union(*(self.cluster.request(rank, {"what": "resident", "released": self._released(rank, [])})
                             for rank in range(1, self.cluster.world)))

    def _message(self, rank: int, what: str, session: Session, slot: DeviceSlot, layers: range) -> dict[str, Any]:
        """A hand-off request to ``rank`` about its mirror of ``session`` on ``slot``, ``layers``."""
        return {"what": what, "released": self._released(rank, [session]), "session": (session.id, session.n_tokens),
                "segment": (slot.index, layers.start, layers.stop)}

    def _released(self, rank: int, sessions: Sequence[Session]) -> list[int]:
        """The ids of the sessions ``rank`` holds mirrors of that were released since it was last told;
        ``sessions`` are held from now on."""
        held = self._held.setdefault(rank, {})
        released = [sid for sid, ref in held.items() if (s := ref()) is None or s.kv.released]
        for sid in released:
            del held[sid]
        for session in sessions:
            held.setdefault(session.id, weakref.ref(session))
        return released

    def _header(self, rank: int, phase: Phase, segment: Segment, hidden: torch.Tensor,
                batch: PromptBatch | DecodeBatch) -> dict[str, Any]:
        """What ``rank`` needs to run ``segment`` of the step (and the sessions released since its last)."""
        header: dict[str, Any] = {
            "op": phase, "segments": [_named(segment)], "sessions": [(s.id, s.n_tokens) for s in batch.sessions],
            "released": self._released(rank, batch.sessions), "shape": tuple(hidden.shape),
            "dtype": str(hidden.dtype).removeprefix("torch."),
        }
        if isinstance(batch, PromptBatch):
            header["lengths"] = batch.lengths
        else:
            header["offsets"] = batch.offsets
        return header

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        self.cluster.close()


def _named(segment: Segment) -> tuple[int, int, int]:
    """``(device slot, first layer, end)`` of ``segment``, as a header carries it."""
    return segment.device, segment.layers.start, segment.layers.stop


class StageServer:
    """Another rank's side: runs the segments rank 0 sends on ``engine`` (loaded with this rank's
    layers only). Each (session, segment) has a mirror session holding that segment's layers, on its
    device slot: hops of one step that reach this rank twice never touch each other's positions."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._mirrors: dict[int, dict[tuple[int, int], Session]] = {}  # session id -> (slot, first layer) -> mirror

    def step(self, header: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
        """Run one hop's segments in order; the hidden state out."""
        self._release(header["released"])
        for slot, start, stop in header["segments"]:
            hidden = self._segment(header, Segment(slot, range(start, stop)), hidden)
        return hidden

    def answer(self, message: dict[str, Any]) -> Any:
        """Rank 0's request: the experts this rank's caches hold (``resident``), or a hand-off
        (:meth:`RemoteStages.hand_off`): rows that ``arrive`` in a session's mirror of a segment, or that
        ``leave`` it (returned as ``(positions, layer -> name -> tensor)``)."""
        self._release(message["released"])
        if message["what"] == "resident":
            return self.engine.resident_experts()
        (sid, n_tokens), (slot, start, stop) = message["session"], message["segment"]
        segment = Segment(slot, range(start, stop))
        if message["what"] == "arrive":
            mirror = self._mirror_of(sid, segment)
            positions, tensors = message["rows"]
            kvtransfer.arrive(mirror.kv, kvtransfer.KVSnapshot(positions, tensors), slot,
                              self.engine.devices[slot].device)
            mirror.tokens[:] = [UNSET] * positions
            return None
        rows = kvtransfer.leave(self._mirror(sid, n_tokens, segment).kv, segment.layers, message["to"])
        return rows.n_tokens, rows.tensors

    def _release(self, released: Sequence[int]) -> None:
        for sid in released:
            for mirror in self._mirrors.pop(sid, {}).values():
                self.engine.release_session(mirror)

    def _segment(self, header: dict[str, Any], segment: Segment, hidden: torch.Tensor) -> torch.Tensor:
        rows = [self._mirror(sid, n, segment) for sid, n in header["sessions"]]
        unique = list({id(s): s for s in rows}.values())
        if header["op"] == "prompt":
            lengths = header["lengths"]
            batch: PromptBatch | DecodeBatch = PromptBatch(tuple(rows), torch.zeros(sum(lengths), dtype=torch.int64),
                                                           tuple(lengths))
            counts = dict(zip(map(id, rows), lengths))
        else:
            batch = DecodeBatch(tuple(rows), torch.zeros(len(rows), dtype=torch.int64),
                                offsets=tuple(header["offsets"]))
            counts = Counter(map(id, rows))
        try:
            for session in unique:
                session.kv.reserve(session.n_tokens + counts[id(session)])
                if header["op"] == "decode" and counts[id(session)] > 1:
                    session.kv.keep_steps()
            out = self.engine.runner.serve_segment(header["op"], segment, hidden, batch)
            for session in unique:
                session.kv.advance(counts[id(session)])
                session.tokens.extend([UNSET] * counts[id(session)])
        finally:
            for session in unique:
                session.kv.trim()
        return out

    def _mirror_of(self, sid: int, segment: Segment) -> Session:
        """The mirror of session ``sid`` for ``segment`` (made empty where there is none)."""
        mirrors = self._mirrors.setdefault(sid, {})
        session = mirrors.get((segment.device, segment.layers.start))
        if session is None:
            engine = self.engine
            homes = {layer: (segment.device, engine.devices[segment.device].device) for layer in segment.layers}
            session = Session(kv=KVCache.for_spec(engine.spec, engine.max_context, dtype=engine.dtype,
                                                  layers=segment.layers, homes=homes, pools=engine.kv_pools))
            mirrors[(segment.device, segment.layers.start)] = session
        return session

    def _mirror(self, sid: int, n_tokens: int, segment: Segment) -> Session:
        """The mirror of session ``sid`` for ``segment``, holding ``n_tokens`` positions as rank 0's does."""
        session = self._mirror_of(sid, segment)
        if session.n_tokens > n_tokens:
            session.truncate(n_tokens)
        if session.n_tokens < n_tokens:
            raise MirrorError(f"this rank holds {session.n_tokens} positions of session {sid}, rank 0 {n_tokens}: "
                              "positions that no step brought here (a shared prefix or a restored conversation)")
        return session


def serve_stages(settings: StrataSettings, launch: Launch, store: torch.distributed.Store | None = None) -> None:
    """Another rank's whole life: join (at ``store``, see :meth:`Cluster.join`), load this rank's
    layers, tell rank 0, run its steps until it says stop (or Ctrl-C); RankFailedError when a rank it
    waits on dies or stops answering."""
    from strata_core.engine import Engine

    cluster = Cluster.join(settings, launch, store)
    try:
        engine = Engine.from_settings(settings, cluster=cluster)
    except Exception as error:
        cluster.ready(error)
        raise
    cluster.ready(None)
    local = [d for d in engine.devices if d.rank == cluster.rank]
    log.info("rank %d: serving %s for rank 0", cluster.rank, ", ".join(map(str, local)))
    try:
        server = StageServer(engine)
        cluster.serve(server.step, local[0].device, server.answer)
        log.info("rank %d: rank 0 said stop", cluster.rank)
    except KeyboardInterrupt:  # torchrun passes Ctrl-C to every rank: rank 0 stops serving too
        log.info("rank %d: interrupted", cluster.rank)
    finally:
        engine.close()
        cluster.close()
