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

Requests with a grammar or log-probabilities take no drafts (their state advances per token);
penalties are applied to each row with its own history. A recurrent state (Qwen3-Next's Gated DeltaNet)
is kept after each row of a request's window (``KVCache.keep_steps``), so the cut puts back the state
after the last token kept; such a window runs eagerly (no CUDA graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["MAX_NGRAM", "Drafter", "NgramDrafter", "accepted"]

#: the longest n-gram looked up
MAX_NGRAM = 3


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


def accepted(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """How many of ``drafts`` are kept: ``drawn[j]`` is the token drawn after the pending token and the
    first ``j`` drafts."""
    kept = 0
    while kept < len(drafts) and drawn[kept] == drafts[kept]:
        kept += 1
    return kept
