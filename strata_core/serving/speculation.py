"""N-gram speculative decoding (``--spec ngram``): drafts from a request's own tokens, verified in its
decode window.

A request's next tokens are guessed by prompt lookup: the tokens that followed the latest earlier
occurrence of its last ``n`` tokens (the longest ``n`` up to ``MAX_NGRAM`` that occurred before), so a
reply that repeats its prompt (code edits, quotes, lists) is drafted ahead. Where that occurrence is
``d`` tokens back with ``d`` less than the draft (the sequence ends in a loop of period ``d``: a run of
spaces, a repeated line), the draft goes on around the loop, ``k`` tokens rather than ``d``. The window
then holds the request's pending token and its ``k`` drafted tokens as ``k + 1`` rows of one session
(``Engine.decode_window``: each row's logits follow the session's tokens up to it, exactly as ``k + 1``
windows of one row would give them). Each row is drawn as the request's draw at that token would be
(its sampler's seed at the step of that token: the draws are counter-based), and the drafts are kept
while each equals the draw of the row before it; the draw after the last kept one is the request's
next token. A token is thus the request's own draw at its step, with the same tokens before it: the
output is the one without drafts, greedy or sampled (for one-hot drafts this is speculative sampling's
rule: a draft is kept with its probability, and a rejected one's replacement follows the rest of the
distribution), ``1 + kept`` tokens a window; the rejected rows' positions are cut from the session
(``Session.truncate``).

A request whose drafts keep missing pauses them (``DraftPacer``): after ``MISSES_BEFORE_PAUSE`` windows in a
row that kept none of its drafts it takes windows without drafts, ``FIRST_PAUSE`` of them, then drafts
again; each probe that keeps nothing doubles the pause (up to ``LONGEST_PAUSE``), and a kept draft ends
them. A rejected draft costs its row of the window (and a recurrent model the window's CUDA graph), so a
request whose drafts miss decodes at about the speed it has without them, and its text is the same.

Requests with a grammar or log-probabilities take no drafts (their state advances per token);
penalties are applied to each row with its own history. A recurrent state (Qwen3-Next's Gated DeltaNet)
is kept after each row of a request's window (``KVCache.keep_steps``), so the cut puts back the state
after the last token kept; such a window runs eagerly (no CUDA graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["FIRST_PAUSE", "LONGEST_PAUSE", "MAX_NGRAM", "MISSES_BEFORE_PAUSE", "DraftPacer", "Drafter",
           "NgramDrafter", "accepted"]

#: the longest n-gram looked up
MAX_NGRAM = 3
#: windows in a row that kept none of a request's drafts before it pauses them
MISSES_BEFORE_PAUSE = 4
#: the first pause, in windows, and the longest (each probe that keeps nothing doubles it)
FIRST_PAUSE, LONGEST_PAUSE = 8, 64


class Drafter(Protocol):
    """A request's drafter: ``extend`` it with the request's tokens as they come, ``draft`` up to ``k``
    tokens after them (n-gram lookup here; the MTP block: strata_core.serving.mtp_drafts)."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def draft(self, k: int) -> list[int]: ...


class NgramDrafter:
    """Prompt lookup over one sequence: ``extend`` it as its tokens come, ``draft`` the next ones."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the sequence."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending just before the new token are followed by it
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end

    def draft(self, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the sequence's longest suffix that
        occurred before (at most ``MAX_NGRAM`` long); none when no suffix did. An occurrence ``d < k``
        tokens back is followed by the sequence's last ``d`` tokens, then by the draft itself (the
        sequence as a loop of period ``d``): ``draft[j] = tokens[at + j % d]``."""
        for n in range(min(MAX_NGRAM, len(self.tokens)), 0, -1):
            at = self._next.get(tuple(self.tokens[-n:]))
            if at is not None:
                period = len(self.tokens) - at
                return [self.tokens[at + j % period] for j in range(k)]
        return []


class DraftPacer:
    """When one request drafts (the module's docstring): ``drafts_now`` before each of its windows, ``record``
    after each window that verified drafts."""

    def __init__(self) -> None:
        self.misses = 0  # windows in a row that kept none of the drafts
        self.pause = 0  # the last pause's length (0: none since a draft was kept)
        self.waiting = 0  # windows left in the pause

    def drafts_now(self) -> bool:
        """Whether this window takes drafts (a window in a pause counts it down)."""
        if self.waiting:
            self.waiting -= 1
            return False
        return True

    def record(self, drafted: int, kept: int) -> None:
        """A window verified ``drafted`` drafts and kept ``kept``."""
        if kept:
            self.misses = self.pause = 0
        elif drafted:
            self.misses += 1
            if self.misses >= MISSES_BEFORE_PAUSE:
                self.pause = min(LONGEST_PAUSE, 2 * self.pause or FIRST_PAUSE)
                self.waiting = self.pause
                self.misses = MISSES_BEFORE_PAUSE - 1  # the probe after it: one more miss pauses again


def accepted(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """How many of ``drafts`` are kept: ``drawn[j]`` is the token drawn after the pending token and the
    first ``j`` drafts."""
    kept = 0
    while kept < len(drafts) and drawn[kept] == drafts[kept]:
        kept += 1
    return kept
