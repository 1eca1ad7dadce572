"""Choosing the next token from logits: greedy or seeded random sampling, llama.cpp's order.

The transforms run in the order of llama.cpp's default sampler chain:

1. ``logit_bias`` added to its tokens' logits; then penalties over the last ``repeat_last_n``
   tokens of ``history``: a repeated token's logit is divided by ``repetition_penalty`` when
   positive and multiplied by it when not, then lowered by ``count * frequency_penalty +
   presence_penalty``;
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

from strata_core.errors import InvalidParamError
from strata_core.serving.stop_strings import MAX_STOP_CHARS, MAX_STOPS

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "SampleResult", "Sampler", "SamplingParams"]

#: seeds a ``torch.Generator`` takes: any signed or unsigned 64-bit integer
SEED_RANGE = range(-(2**63), 2**64)
MAX_LOGPROBS = 20


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``InvalidParamError`` naming the field.

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
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", tuple((i, b) for i, b in self.logit_bias))
        checks = [
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", _finite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
             "in [0.01, 100]"),
            ("frequency_penalty", _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("repeat_last_n", _int(self.repeat_last_n) and self.repeat_last_n >= 0, "an integer >= 0"),
            ("seed", self.seed is None or (_int(self.seed) and self.seed in SEED_RANGE),
             "a 64-bit integer (-2**63 <= seed < 2**64) or None"),
            ("max_tokens", self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
             "an integer >= 1 or None"),
            ("stop", len(self.stop) <= MAX_STOPS, f"at most {MAX_STOPS} strings"),
            ("stop", all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("logprobs", self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}] or None"),
            ("logit_bias", all(_int(i) and i >= 0 and _finite(b) for i, b in self.logit_bias),
             "pairs of a token id >= 0 and a finite bias"),
        ]
        for name, ok, expected in checks:
            if not ok:
                shown = repr(getattr(self, name))
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise InvalidParamError(f"sampling parameter {name} must be {expected}, got {shown}", name)

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
        """Step 1: logit bias, then repetition, frequency and presence penalties over the recent
        history (a new tensor when anything changes)."""
        p = self.params
        if p.logit_bias:
            logits = logits.clone()
            ids = torch.tensor([i for i, _ in p.logit_bias], dtype=torch.long)
            logits[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype)
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
        top = masked.max()
        if not torch.isfinite(top):
            raise FloatingPointError(f"cannot sample: the largest allowed logit is {float(top)}")
        # shifted so the top logit is 0, divided in float64: a tiny temperature cannot make inf - inf or 0 / 0
        probs = torch.softmax((masked - top).double() / self.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
