"""Segments on other ranks: rank 0 sends them (:class:`RemoteStages`), the other ranks run them
(:func:`serve_stages`).

A step's header names the segment (device slot, layers), the phase, each row's session id and the
positions it holds before the step, the chunk lengths (prompt) or row offsets (decode), and the ids
of sessions released since; the hidden state follows. The other rank keeps a mirror session per id
holding its layers' KV: a mirror longer than rank 0's session is cut back to it (a request reusing
a slot's prefix, rejected drafts, a step that failed after this rank ran), one shorter is an error
(prefix sharing and the conversation cache, which hold positions no step brought, are off across
ranks).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from strata_core.config import StrataSettings
from strata_core.errors import StrataError
from strata_core.plugin.placement import DeviceSlot, Phase, Segment
from strata_core.remote.group import Cluster
from strata_core.remote.launch import Launch
from strata_core.runtime.session import UNSET, DecodeBatch, PromptBatch, Session

if TYPE_CHECKING:
    from strata_core.engine import Engine

__all__ = ["RemoteStages", "StageServer", "serve_stages"]

log = logging.getLogger(__name__)


class MirrorError(StrataError):
    """A rank holds fewer positions of a session than rank 0 says it has."""


class RemoteStages:
    """Rank 0's side: a segment whose device slot is another rank's, run by sending the step there.

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

    def run(self, phase: Phase, segment: Segment, hidden: torch.Tensor, batch: PromptBatch | DecodeBatch
            ) -> torch.Tensor:
        """``hidden [T, H]`` through ``segment`` on its rank: one hop, its answer on ``hidden``'s device."""
        rank = self._devices[segment.device].rank
        held = self._held.setdefault(rank, {})
        released = [sid for sid, ref in held.items() if (s := ref()) is None or s.kv.released]
        for sid in released:
            del held[sid]
        for session in batch.sessions:
            held.setdefault(session.id, weakref.ref(session))
        header: dict[str, Any] = {
            "op": phase, "slot": segment.device, "layers": (segment.layers.start, segment.layers.stop),
            "sessions": [(s.id, s.n_tokens) for s in batch.sessions], "released": released,
            "shape": tuple(hidden.shape), "dtype": str(hidden.dtype).removeprefix("torch."),
        }
        if isinstance(batch, PromptBatch):
            header["lengths"] = batch.lengths
        else:
            header["offsets"] = batch.offsets
        return self.cluster.exchange(rank, header, hidden).to(hidden.device)

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        self.cluster.close()


class StageServer:
    """Another rank's side: runs the segments rank 0 sends on ``engine`` (loaded with this rank's
    layers only), each session mirrored by id."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions: dict[int, Session] = {}

    def step(self, header: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
        """Run one step's segment; the hidden state out."""
        for sid in header["released"]:
            if (session := self._sessions.pop(sid, None)) is not None:
                self.engine.release_session(session)
        rows = [self._mirror(sid, n) for sid, n in header["sessions"]]
        segment = Segment(header["slot"], range(*header["layers"]))
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

    def _mirror(self, sid: int, n_tokens: int) -> Session:
        """The mirror of session ``sid``, holding ``n_tokens`` positions as rank 0's does."""
        session = self._sessions.get(sid)
        if session is None:
            session = self._sessions[sid] = self.engine.new_session()
        if session.n_tokens > n_tokens:
            session.truncate(n_tokens)
        if session.n_tokens < n_tokens:
            raise MirrorError(f"this rank holds {session.n_tokens} positions of session {sid}, rank 0 {n_tokens}: "
                              "positions that no step brought here (a shared prefix or a restored conversation)")
        return session


def serve_stages(settings: StrataSettings, launch: Launch) -> None:
    """Another rank's whole life: join, load this rank's layers, tell rank 0, run its steps until it
    says stop; RankFailedError when rank 0 dies or stops answering."""
    from strata_core.engine import Engine

    cluster = Cluster.join(settings, launch)
    try:
        engine = Engine.from_settings(settings, cluster=cluster)
    except Exception as error:
        cluster.ready(error)
        raise
    cluster.ready(None)
    local = [d for d in engine.devices if d.rank == cluster.rank]
    log.info("rank %d: serving %s for rank 0", cluster.rank, ", ".join(map(str, local)))
    try:
        cluster.serve(StageServer(engine).step, local[0].device)
    finally:
        engine.close()
        cluster.close()
    log.info("rank %d: rank 0 said stop", cluster.rank)
