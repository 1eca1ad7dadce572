"""What the next scheduler step runs: the policy, decided without an engine.

A step runs one decode window over every stream that decodes, then prompt chunks of the requests
still prefilling, under a token budget (``--step-tokens``):

- a decode row is one token of the budget, and every decoding stream gets its row;
- the rest of the budget goes to prompt chunks in admission order: the oldest request gets as much
  of its remaining prompt as fits, then the next, so a request admitted earlier always has its
  chunks before a later one, and a long prompt holds the running streams back by one step's budget
  at most;
- a step with no decode row keeps no stream waiting: its chunks may take ``idle_tokens`` (the
  engine's own prompt chunk, when larger), so a prompt on an idle server makes as few passes over
  the experts as the engine alone would.

With ``step_tokens >= parallel`` no request starves: a prefilling slot does not decode, so while one
prefills at most ``parallel - 1`` rows decode and the oldest gets at least
``step_tokens - parallel + 1`` tokens (or the rest of its prompt) in every step. A request admitted
behind ``T`` prompt tokens still to compute (its own included) has finished its prefill within
``ceil(T / (step_tokens - parallel + 1))`` steps; with ``piece = step_tokens - parallel + 1`` the oldest
takes at least its next piece or its rest each step, so within the sum of its and the older prompts'
``ceil(left / piece)`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["StepPlan", "plan_step"]

K = TypeVar("K")


@dataclass(frozen=True)
class StepPlan(Generic[K]):
    """The streams that decode this step, and the prompt chunks: (request, tokens), oldest first."""

    decode: tuple[K, ...]
    chunks: tuple[tuple[K, int], ...]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the step computes."""
        return sum(n for _, n in self.chunks)


def plan_step(decoding: Sequence[K], prefilling: Sequence[tuple[K, int]], step_tokens: int,
              idle_tokens: int = 0, piece: int = 0) -> StepPlan[K]:
    """Plan one step under ``step_tokens``.

    :param decoding: the streams that decode (each costs one token).
    :param prefilling: ``(request, prompt tokens still to compute)``, oldest admission first.
    :param step_tokens: the budget of a step that decodes.
    :param idle_tokens: the budget of a step with no decode row, if larger than ``step_tokens``.
    :param piece: if set, a chunk that does not end its prompt is a multiple of ``piece`` tokens.
    :return: every decoding stream, and chunks filling the rest of the budget in admission order.
    """
    budget = step_tokens - len(decoding) if decoding else max(step_tokens, idle_tokens)
    chunks = []
    for request, left in prefilling:
        if budget <= 0:
            break
        n = min(left, budget)
        if n < left:  # the budget ends inside this prompt: the requests behind it wait
            n -= n % piece if piece else 0
            if n:
                chunks.append((request, n))
            break
        chunks.append((request, n))
        budget -= n
    return StepPlan(tuple(decoding), tuple(chunks))
