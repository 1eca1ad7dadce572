"""Choosing the next token from logits: greedy or seeded random sampling, llama.cpp's order.

The transforms run in the order of llama.cpp's default sampler chain:

1. penalties over the last ``repeat_last_n`` tokens of ``history``: a repeated token's logit is
   divided by ``repetition_penalty`` when positive and multiplied by it when not, then lowered by
   ``count * frequency_penalty + presence_penalty``;
2. top-k: keep the ``top_k`` largest logits (ties go to the lower id);
3. top-p: keep the smallest set of most likely tokens whose probability reaches ``top_p``;
4. min-p: keep tokens whose probability is at least ``min_p`` times the top one's;
5. temperature: divide the logits by ``temperature``, then draw from the softmax.

Probabilities in steps 3-4 are those at temperature 1, as in llama.cpp. ``temperature == 0`` is
greedy: the argmax after the penalties (the lowest id on ties), with no randomness at all.
Sampling runs on the CPU in float32 with the sampler's own ``torch.Generator``, so a seed gives the
same tokens whatever device produced the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence

import torch

from strata_core.errors import RequestError

__all__ = ["SampleResult", "Sampler", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``RequestError`` naming the field.

    ``top_k=0``, ``top_p=1``, ``min_p=0`` and penalties of 1/0 switch those steps off;
    ``seed=None`` draws a fresh seed; ``max_tokens=None`` generates until an end token or the
    context is full; ``logprobs=n`` reports the chosen token's log-probability and the ``n`` most
    likely alternatives (``None``: none).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default=())
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "a finite number > 0"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty), "a finite number"),
            ("presence_penalty", math.isfinite(self.presence_penalty), "a finite number"),
            ("repeat_last_n", self.repeat_last_n >= 0, "an integer >= 0"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "an integer >= 1 or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "an integer >= 0 or None"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise RequestError(f"sampling parameter {name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (``temperature == 0``)."""
        return self.temperature == 0


@dataclass(frozen=True)
class SampleResult:
    """A chosen token; with ``logprobs`` requested, its log-probability and the top alternatives.

    Log-probabilities are of the model's distribution (``log_softmax`` of the raw logits, before
    penalties and temperature), as OpenAI-style APIs report them.
    """

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Picks tokens for one sequence with ``params``; holds the seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def sample(self, logits: torch.Tensor, history: Sequence[int] | Sequence[Sequence[int]] = ()) -> int | list[int]:
        """The next token for logits ``[V]`` (an int), or one per row of ``[B, V]`` (a list).

        ``history`` is the sequence's tokens so far (prompt and generated), a list per row for ``[B, V]``.
        """
        if logits.dim() == 1:
            return self.sample_result(logits, history).token  # type: ignore[arg-type]
        rows = history if len(history) else [()] * logits.shape[0]
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} histories")
        return [self.sample_result(row, hist).token for row, hist in zip(logits, rows)]  # type: ignore[arg-type]

    def sample_result(self, logits: torch.Tensor, history: Sequence[int] = ()) -> SampleResult:
        """Like ``sample`` for one row ``[V]``, with log-probabilities when ``params.logprobs`` is set."""
        raw = logits.detach().to("cpu", torch.float32)
        token = self._choose(self.penalize(raw, history))
        if self.params.logprobs is None:
            return SampleResult(token)
        logp = torch.log_softmax(raw, dim=-1)
        top = torch.topk(logp, min(self.params.logprobs, logp.numel()))
        return SampleResult(token, float(logp[token]), tuple(zip(top.indices.tolist(), top.values.tolist())))

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """Step 1: repetition, frequency and presence penalties over the recent history (a new tensor)."""
        p = self.params
        recent = list(history)[-p.repeat_last_n :] if p.repeat_last_n else []
        if not recent or (p.repetition_penalty == 1 and p.frequency_penalty == 0 and p.presence_penalty == 0):
            return logits
        ids, counts = torch.tensor(recent, dtype=torch.long).unique(return_counts=True)
        out = logits.clone()
        values = out[ids]
        values = torch.where(values <= 0, values * p.repetition_penalty, values / p.repetition_penalty)
        out[ids] = values - counts.to(values.dtype) * p.frequency_penalty - p.presence_penalty
        return out

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 2-4: a bool mask of the tokens top-k, top-p and min-p leave (never empty)."""
        p = self.params
        order = torch.sort(logits, descending=True, stable=True).indices
        keep = torch.ones_like(logits, dtype=torch.bool)
        if p.top_k:
            keep[order[p.top_k :]] = False
        if p.top_p < 1:
            probs = torch.softmax(logits.masked_fill(~keep, -math.inf), dim=-1)[order]
            before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
            keep[order[1:][before[1:] >= p.top_p]] = False
        if p.min_p > 0:
            threshold = logits[order[0]] + math.log(p.min_p)
            keep &= logits >= threshold
        return keep

    def _choose(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(torch.argmax(logits))
        masked = logits.masked_fill(~self.allowed(logits), -math.inf)
        probs = torch.softmax(masked / self.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
