"""What a generation request is and what it yields: the request, its events, timings, errors.

The scheduler produces these; the server turns them into OpenAI-style responses.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_core.errors import RequestError, StrataError
from strata_core.sampling import SamplingParams

__all__ = [
    "ContextLengthError", "Delta", "Finished", "GenerationRequest", "SchedulerStats", "ServerBusyError", "Timings",
    "TokenLogprob",
]  # fmt: skip


class ServerBusyError(StrataError):
    """Every slot is busy and the queue is full (HTTP 503)."""


class ContextLengthError(RequestError):
    """The prompt does not fit in a session's context."""


@dataclass
class GenerationRequest:
    """One generation: prompt token ids, and how to sample and when to stop (``max_tokens``,
    ``stop``, ``logprobs`` of the params; ``max_tokens=None`` runs until the context is full)."""

    prompt: list[int]
    params: SamplingParams


@dataclass
class TokenLogprob:
    """Log-probability of a generated token, with the top alternatives."""

    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass
class Delta:
    """New text and the tokens that produced it."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Timings:
    """Per-request timings, named like llama-server's ``timings``."""

    prompt_n: int = 0  # prompt tokens computed (not from the cache)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0  # prompt tokens whose KV was reused

    def to_dict(self) -> dict[str, float | int]:
        """The llama-server ``timings`` object."""
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": _rate(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": _rate(self.predicted_n, self.predicted_ms),
            "cache_n": self.cache_n,
        }


def _rate(n: int, ms: float) -> float:
    return n / ms * 1000.0 if ms > 0 else 0.0


@dataclass
class Finished:
    """The request is done: why (``stop`` or ``length``), token counts and timings."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


@dataclass
class SchedulerStats:
    """Counters since start (written by the worker, read by /metrics)."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    windows: int = 0
    active: int = 0
    waiting: int = 0
