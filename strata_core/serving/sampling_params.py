"""What a request asks of the sampler: :class:`SamplingParams` (checked on construction, each bad
value an ``InvalidParamError`` naming its field) and what it gets back, :class:`SampleResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from strata_core.errors import InvalidParamError
from strata_core.serving.stop_strings import MAX_STOP_CHARS, MAX_STOPS

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "SampleResult", "SamplingParams"]

#: seeds: any signed or unsigned 64-bit integer (taken modulo 2**64)
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
    likely alternatives (``None``: none); ``ignore_eos``: an end token does not end the generation
    (benchmarks that want ``max_tokens`` from every request).
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
    ignore_eos: bool = False

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
    penalties and temperature), as OpenAI-style APIs report them. ``complete``: the sequence's
    grammar accepts nothing after this token.
    """

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    complete: bool = False
