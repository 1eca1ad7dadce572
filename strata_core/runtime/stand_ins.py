"""Stand-in sessions: what a decode graph of the unfused layers reads, so that one graph of a bucket serves any
sessions.

The fused decode kernels reach the KV through address tables, a graph's inputs (fused_decode.kv_tables). The
unfused layers (gpt-oss, deepseek2, qwen3next, a shared expert) read a session's KV through its cache's row ids
and its recurrent state tensors: addresses a graph would keep, so that every new set of sessions captured again.
Their windows run on *stand-ins* instead: caches over the same pools that hold no blocks (``KVCache.stand_in``),
row b of a window standing in for whichever session has that row.

- Each row's block table of the segment's slot is a graph input (``tables``, int32 ``[B, max_blocks]``,
  refilled before each replay as the fused path's address tables are); the captured body turns it into the
  stand-ins' row ids with one op (``follow``), so their reads and writes land in the real session's blocks.
- A recurrent state (Gated DeltaNet) is copied into the stand-in of the session's row before the replay and
  back after it (``load`` / ``store``: one multi-tensor copy each way; padding rows keep what they had).
- A window where a session with recurrent state has several rows (a speculative window keeping its states
  after each row) has no stand-ins: it runs eagerly.

One set of stand-ins per segment, grown to the largest window seen; a bucket of B takes the first B.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from strata_core.runtime.session import DecodeBatch, Session

if TYPE_CHECKING:
    from strata_core.plugin.placement import Segment

__all__ = ["StandIns"]

log = logging.getLogger(__name__)


class StandIns:
    """The stand-in sessions of ``segment``'s unfused decode graphs."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._sessions: list[Session] = []
        self._stateful: bool | None = None  # whether the segment's layers hold recurrent state (found once)

    def why_not(self, batch: DecodeBatch) -> str | None:
        """Why ``batch``'s rows cannot run on stand-ins, or None when they can."""
        layers, slot = self.segment.layers, self.segment.device
        first = batch.sessions[0].kv
        for session in {id(s): s for s in batch.sessions}.values():
            kv = session.kv
            if kv.max_tokens != first.max_tokens:
                return "the window's sessions hold different context lengths"
            if kv.home.get(layers.start) != slot or kv.home.get(layers.stop - 1) != slot:
                return f"a session's layers {layers.start}..{layers.stop - 1} are not at home on slot {slot}"
        if batch.offsets and self._holds_state(first):
            return "a session keeps a recurrent state across several rows of the window"
        return None

    def window(self, batch: DecodeBatch) -> DecodeBatch:
        """``batch`` with row b's session replaced by stand-in b (made at first need, like the batch's first
        session's cache)."""
        while len(self._sessions) < len(batch):
            self._sessions.append(Session(kv=batch.sessions[0].kv.stand_in(self.segment.layers)))
            if len(self._sessions) == len(batch):
                state = sum(t.numel() * t.element_size() for t in self._states(self._sessions[:1]))
                log.info("cuda graphs: %d stand-in sessions for slot %d layers %d..%d (%.1f MiB of recurrent "
                         "state)", len(self._sessions), self.segment.device, self.segment.layers.start,
                         self.segment.layers.stop - 1, len(self._sessions) * state / 2 ** 20)
        return DecodeBatch(tuple(self._sessions[:len(batch)]), batch.tokens, batch.fed, batch.offsets)

    def tables(self, batch: DecodeBatch) -> torch.Tensor:
        """int32 ``[B, max_blocks]``: each row's session's block table on the segment's slot (a graph input)."""
        return torch.stack([session.kv.block_table(self.segment.layers.start) for session in batch.sessions])

    def follow(self, window: DecodeBatch, tables: torch.Tensor) -> None:
        """Point each stand-in of ``window`` at the blocks of its row of ``tables`` (int32 ``[B, max_blocks]``, on
        the segment's device): their row ids computed from it in one op, inside the captured body."""
        kv = window.sessions[0].kv
        lanes = torch.arange(kv.block_size, device=tables.device)
        rows = (tables.long()[:, :, None] * kv.block_size + lanes).view(len(window), -1)  # [B, max_blocks * bs]
        for b, session in enumerate(window.sessions):
            session.kv.follow(self.segment.device, rows[b])

    def load(self, batch: DecodeBatch, window: DecodeBatch, live: int) -> None:
        """Copy the recurrent state of ``batch``'s first ``live`` rows' sessions into their stand-ins in ``window``."""
        self._copy(window.sessions[:live], batch.sessions[:live])

    def store(self, batch: DecodeBatch, window: DecodeBatch, live: int) -> None:
        """Copy the stand-ins' recurrent state back into the sessions of ``batch``'s first ``live`` rows."""
        self._copy(batch.sessions[:live], window.sessions[:live])

    def _copy(self, dst: tuple[Session, ...], src: tuple[Session, ...]) -> None:
        if dst and self._holds_state(dst[0].kv):  # no host work a window for layers without recurrent state
            torch._foreach_copy_(self._states(dst), self._states(src), non_blocking=True)

    def _states(self, sessions: tuple[Session, ...] | list[Session]) -> list[torch.Tensor]:
        """The recurrent state tensors of ``sessions`` in the segment's layers, in one order."""
        return [t for s in sessions for i in self.segment.layers for _, t in sorted(s.kv.recurrent(i).items())]

    def _holds_state(self, kv) -> bool:
        """Whether the segment's layers of a cache like ``kv`` hold recurrent state (found at the first call)."""
        if self._stateful is None:
            self._stateful = any(kv.recurrent(i) for i in self.segment.layers)
        return self._stateful
