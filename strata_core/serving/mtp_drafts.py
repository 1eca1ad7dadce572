"""MTP speculative drafts (``--spec mtp``): each session's state for the model's MTP block
(strata_core.model.mtp), fed the main model's hidden states, drafting greedily.

MTP *entry* t of a session is the block run at the main model's position t: it reads the main model's
hidden state there and the token at t + 1, writes the block's K/V at t and predicts the token at t + 2.
The engine's runner hands over every pass's hidden rows (``take``: the rows of a prompt chunk or of a
decode window, by session). They wait until the session's next ``draft``, when the token after each is
known: the rows up to the session's last position are fed as entries (in chunks, as a prompt is), the last
one drafting the token after the request's pending one; the block's output then stands in for the next
hidden state, chained once a further draft (those entries are cut again: the verified tokens' own hidden
rows replace them at the next draft).

The entries follow the session exactly, so the block's KV is cut back with the session's: rows computed
again from a position (a session cut back, as a slot's session reused for a new prompt) cut the entries
from there, and an entry is kept only while its position is still held and the token it was fed is still
the one after it. Hidden rows a window computed for rejected drafts are dropped (positions no longer
held). Where no row is held for the position after the last entry (a session whose first rows are not at
its first position: a prompt prefix shared from other sessions, a restored conversation; or one cut back
to a position whose next token changed, whose row was fed and not kept), the entries start again at the
first row held: the block's attention then sees the positions from there (RoPE is relative: the entry
positions are counted from the first).

With ``min_p`` (``--spec-min-p``) the chain stops at the first draft the block gives less than that
probability: that draft and the ones after it are not verified (a draft seldom kept costs a row of the
window for nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from strata_core.model.kvcache import KVCache
from strata_core.model.kvpool import KVPoolFull
from strata_core.model.mtp import MtpHead
from strata_core.runtime.session import Session

__all__ = ["MtpDrafter", "MtpDrafts"]

log = logging.getLogger(__name__)


@dataclass
class _Entries:
    """One session's MTP block state: its KV (entry i at the session's position ``start + i``), the token
    each entry was fed, the hidden rows not yet fed and the last entry's output."""

    kv: KVCache
    start: int = 0
    fed: list[int] = field(default_factory=list)  # entry i was fed the token at start + i + 1
    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, [n, H]) in order
    last: tuple[torch.Tensor, int, float] | None = None  # the last entry's output [1, H], its draft, its probability

    @property
    def end(self) -> int:
        """The position of the next entry."""
        return self.start + len(self.fed)

    def cut(self, n: int) -> None:
        """Keep the first ``n`` entries."""
        if n < len(self.fed):
            self.kv.truncate(n)
            del self.fed[n:]
            self.last = None

    def restart(self, start: int) -> None:
        """No entries; the first one will be at position ``start``."""
        self.cut(0)
        self.start = start


class MtpDrafts:
    """Every session's MTP state under ``head``; prompt rows are fed ``chunk`` positions at a time; a
    window's drafts end before the first the block gives less than ``min_p`` probability."""

    def __init__(self, head: MtpHead, chunk: int, min_p: float = 0.0) -> None:
        self.head = head
        self.chunk = chunk
        self.min_p = min_p
        self._sessions: dict[int, _Entries] = {}

    def take(self, session: Session, position: int, hidden: torch.Tensor) -> None:
        """The main model's hidden rows ``[n, H]`` of ``session`` at positions ``position, ...`` (the
        runner's hidden sink): they replace any rows held from ``position`` on, and the entries fed
        rows from there are cut (the session was cut back and computes those positions again)."""
        entries = self._sessions.get(session.id)
        if entries is None:
            entries = self._sessions[session.id] = _Entries(self.head.new_cache(), start=position)
        if position < entries.start:
            entries.restart(position)
        entries.cut(position - entries.start)
        entries.rows = _before(entries.rows, position)
        entries.rows.append((position, hidden))

    def release(self, session: Session) -> None:
        """Forget ``session``'s state (its KV blocks go back to the block's pools)."""
        entries = self._sessions.pop(session.id, None)
        if entries is not None:
            entries.kv.release()

    def draft(self, session: Session, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens drafted after ``tokens`` (the session's tokens and the pending one after them),
        greedily, ending before the first of less than ``min_p`` probability; none before the session has
        any hidden rows, nor while the block's KV pool is full (the drafts are only a guess: the request
        goes on without)."""
        entries = self._sessions.get(session.id)
        if entries is None or k <= 0:
            return []
        drafts: list[int] = []
        try:
            self._sync(entries, session.n_tokens, tokens)
            if entries.last is None:
                return []
            x, token, p = entries.last
            for i in range(k):  # chained entries past the session's positions, cut again below
                if p < self.min_p:
                    break
                drafts.append(token)
                if i + 1 < k:
                    x, logits = self._feed(entries, x, [token], len(entries.fed) + i)
                    token, p = _greedy(logits[-1])
        except KVPoolFull as full:
            log.warning("no MTP drafts for session %d: %s", session.id, full)
            return []
        finally:
            entries.kv.truncate(len(entries.fed))
        return drafts

    def _sync(self, entries: _Entries, n: int, tokens: Sequence[int]) -> None:
        """Entries up to position ``n - 1`` (a session of ``n`` positions, ``tokens`` its tokens and the
        pending one): the stale ones cut, the held rows fed."""
        keep = 0
        while (keep < len(entries.fed) and entries.start + keep < n
               and entries.fed[keep] == tokens[entries.start + keep + 1]):
            keep += 1
        entries.cut(keep)
        rows = [(p, h[max(0, entries.end - p):n - p]) for p, h in entries.rows if p < n and p + len(h) > entries.end]
        entries.rows = []
        if not rows:
            return
        if rows[0][0] > entries.end:  # no rows for the positions between: the entries start again after them
            entries.restart(rows[0][0])
        hidden = torch.cat([h for _, h in rows])  # [m, H]: positions end .. n - 1
        for a in range(0, len(hidden), self.chunk):
            part = hidden[a:a + self.chunk]
            at = entries.end
            x, logits = self._feed(entries, part, tokens[at + 1:at + 1 + len(part)], len(entries.fed))
            entries.fed.extend(tokens[at + 1:at + 1 + len(part)])
            entries.last = (x[-1:], *_greedy(logits[-1]))

    def _feed(self, entries: _Entries, hidden: torch.Tensor, tokens: Sequence[int],
              first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over ``hidden [T, H]`` and ``tokens`` as entries ``first, first + 1, ...``, committed to
        its KV: its output ``[T, H]`` and the last entry's logits ``[1, V]``."""
        positions = torch.arange(first, first + len(tokens))
        entries.kv.reserve(first + len(tokens))
        logits, x = self.head.forward(hidden, torch.tensor(list(tokens), dtype=torch.int64), positions, entries.kv)
        entries.kv.advance(len(tokens))
        return x, logits


class MtpDrafter:
    """A request's drafter (``speculation.Drafter``) over the engine's ``MtpDrafts``: ``extend`` it as its
    tokens come, ``draft`` the next ones."""

    def __init__(self, drafts: MtpDrafts, session: Session, tokens: Sequence[int] = ()) -> None:
        self._drafts = drafts
        self._session = session
        self.tokens: list[int] = list(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the sequence."""
        self.tokens.extend(tokens)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens the MTP block drafts after the sequence (its last token: the pending one)."""
        return self._drafts.draft(self._session, self.tokens, k)


def _greedy(logits: torch.Tensor) -> tuple[int, float]:
    """The most likely token of ``logits [V]`` and its probability."""
    probs = torch.softmax(logits.float(), dim=-1)
    token = int(torch.argmax(probs))
    return token, float(probs[token])


def _before(rows: list[tuple[int, torch.Tensor]], position: int) -> list[tuple[int, torch.Tensor]]:
    """``rows`` cut to the positions before ``position``."""
    return [(p, h[:position - p]) for p, h in rows if p < position]
