"""The generation slots and the sessions they hold: which slot, and which session, a request gets.

A request that leaves its slot leaves its session there, so the next prompt that shares its prefix
computes only the new part. A slot taken by another request first displaces its idle session: where
the engine shares prefixes, the session's full KV blocks are published and released, and stay
cached on the device until an allocation needs them (model/kvpool.py), so a returning conversation
takes them back without a copy (the partial last block, fewer tokens than a block, is computed
again); where it does not (a recurrent state is per session, not paged), the session is saved in
the :class:`~strata_core.serving.conv_cache.ConvCache` in host RAM, from which it is restored.
Under ``--batch-invariant`` nothing is reused: on CUDA a prompt's KV computed in other chunks, or its
last token run as a decode row, would give other bits than the prompt computed alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strata_core.serving.conv_cache import ConvCache, common_prefix

__all__ = ["Slot", "Slots"]


@dataclass(eq=False)
class Slot:
    """One place for a running request: its session, or an idle one kept for prefix reuse."""

    session: Any = None
    job: Any = None  # the scheduler's record of the request running here
    last_used: int = 0


class Slots:
    """``n`` slots over ``engine``'s sessions, with ``cache`` for the sessions they displace."""

    def __init__(self, engine: Any, n: int, cache: ConvCache) -> None:
        self.engine = engine
        self.cache = cache
        self.reuse = not engine.settings.batch_invariant
        self.all = [Slot() for _ in range(n)]
        self._clock = 0

    def idle(self) -> list[Slot]:
        """The slots no request runs in."""
        return [s for s in self.all if s.job is None]

    def busy(self) -> list[Slot]:
        """The slots a request runs in."""
        return [s for s in self.all if s.job is not None]

    def place(self, prompt: Sequence[int], idle: list[Slot]) -> Slot:
        """The idle slot for ``prompt``, its session holding the longest known prefix of it (the last
        prompt token is always left to compute, for its logits); the caller sets ``slot.job``."""
        rewindable = self.engine.spec.rewindable  # else a held state is reused whole or not at all
        live, live_n = idle[0], 0
        for s in idle:  # a session is reused in place when it is mostly this prompt's prefix
            if s.session is None or not self.reuse:
                continue
            n = common_prefix(s.session.tokens, prompt[:-1])
            if n > live_n and 2 * n >= s.session.n_tokens and (rewindable or n == s.session.n_tokens):
                live, live_n = s, n
        key, cache_n = self.cache.best(prompt[:-1], whole=not rewindable) if self.reuse else (None, 0)
        if live_n > 0 and live_n >= cache_n:
            slot, cached = live, live_n
        else:
            # Taken before displacing can evict it. A conversation used in full moves into the slot
            # (it is put back, grown, when displaced); one sharing only a prefix with this prompt
            # stays cached whole, else a shared chat-template opening would cut it to those tokens.
            snapshot = None
            if key is not None:
                whole = cache_n == self.cache.n_tokens(key)
                snapshot = self.cache.take(key) if whole else self.cache.peek(key)
            slot = min(idle, key=lambda s: (s.session is not None, s.last_used))
            self._displace(slot)
            if snapshot is not None:
                slot.session, cached = self.engine.restore_session(snapshot), cache_n
            else:  # holding the KV blocks of this prompt's opening that another request computed, if any
                slot.session = self.engine.new_session(prompt[:-1] if self.reuse else ())
                cached = slot.session.n_tokens
        if slot.session.n_tokens > cached:
            slot.session.truncate(cached)
        return slot

    def free(self, slot: Slot) -> None:
        """The slot's request left; its session stays for prefix reuse."""
        slot.job = None
        self._clock += 1
        slot.last_used = self._clock

    def drop(self, slot: Slot) -> None:
        """Release the slot's session."""
        if slot.session is not None:
            self.engine.release_session(slot.session)
            slot.session = None

    def _displace(self, slot: Slot) -> None:
        """Free the slot's idle session: its full KV blocks stay cached on the device where the engine
        shares prefixes, else a snapshot of it goes to the conversation cache."""
        session = slot.session
        if session is None:
            return
        if self.reuse and self.engine.shares_prefixes:
            self.engine.release_session(session, cache=True)
            slot.session = None
            return
        if session.n_tokens and self.cache.max_entries:
            self.cache.put(list(session.tokens), self.engine.save_session(session))
        self.drop(slot)
