"""What a generation request is and what it yields: the request, its events, timings, errors.

The scheduler produces these; the server turns them into OpenAI-style responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from strata_core.errors import RequestError, StrataError
from strata_core.serving.grammar import TokenConstraint
from strata_core.serving.sampling import SamplingParams

__all__ = [
    "ContextLengthError", "Delta", "ExpertUsage", "Finished", "GenerationRequest", "RequestCancelled", "SchedulerStats", "ServerBusyError", "Timings",
    "TokenLogprob",
]  # fmt: skip


class ServerBusyError(StrataError):
    """Every slot is busy and the queue is full (HTTP 503)."""


class ShuttingDownError(ServerBusyError):
    """The server is shutting down: it takes no new request and ends the running ones (HTTP 503)."""


class RequestCancelled(StrataError):
    """The request was cancelled (its client went away) before it finished."""


class ContextLengthError(RequestError):
    """The prompt does not fit in a session's context: its ``n_prompt_tokens`` (a lower bound where it
    was refused before tokenizing) and the context's ``n_ctx``, the counts llama-server reports."""

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


@dataclass
class GenerationRequest:
    """One generation: prompt token ids, and how to sample and when to stop (``max_tokens``,
    ``stop``, ``logprobs`` of the params; ``max_tokens=None`` runs until the context is full).
    ``keep_special_tokens``: the text keeps control tokens (a harmony reply's channel markers).
    ``constraint``: the grammar the generated tokens follow (None: any), this request's own."""

    prompt: list[int]
    params: SamplingParams
    keep_special_tokens: bool = False
    constraint: TokenConstraint | None = None


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
class ExpertUsage:
    """Expert-residency counters of one phase of a request.

    Prompt chunks run one request at a time, so the prompt figures are the request's own; a decode
    window serves every active request at once, so each request is credited the whole window's.
    """

    hits: int = 0
    misses: int = 0
    bytes_streamed: int = 0
    copy_s: float = 0.0
    compute_s: float = 0.0

    def add(self, before: Mapping[str, float], after: Mapping[str, float]) -> None:
        """Add the engine telemetry accumulated between two ``snapshot()`` readings."""

        def grown(key: str) -> float:
            return after.get(key, 0) - before.get(key, 0)

        self.hits += int(grown("expert_hits"))
        self.misses += int(grown("expert_misses"))
        self.bytes_streamed += int(grown("bytes_streamed"))
        self.copy_s += grown("copy_s")
        self.compute_s += grown("compute_s")

    def to_dict(self) -> dict[str, float | int]:
        """Hit rate, bytes streamed, link GB/s, time in copies and in expert compute."""
        routed = self.hits + self.misses
        return {
            "hit_rate": self.hits / routed if routed else 1.0,
            "bytes_streamed": self.bytes_streamed,
            "link_gbps": self.bytes_streamed / self.copy_s / 1e9 if self.copy_s > 0 else 0.0,
            "copy_ms": self.copy_s * 1000.0,
            "compute_ms": self.compute_s * 1000.0,
        }


@dataclass
class Timings:
    """Per-request timings, named like llama-server's ``timings``, plus expert-residency figures."""

    prompt_n: int = 0  # prompt tokens computed (not from the cache)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0  # prompt tokens whose KV was reused
    draft_n: int = 0  # tokens drafted by speculative decoding (llama-server's names) ...
    draft_n_accepted: int = 0  # ... and kept
    prompt_experts: ExpertUsage = field(default_factory=ExpertUsage)
    decode_experts: ExpertUsage = field(default_factory=ExpertUsage)

    def to_dict(self) -> dict[str, object]:
        """The llama-server ``timings`` object (its ``draft_n`` / ``draft_n_accepted`` when drafts were
        made) with ``experts`` (prompt / decode) added."""
        drafts = {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}
        return {
            **drafts,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": _rate(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": _rate(self.predicted_n, self.predicted_ms),
            "cache_n": self.cache_n,
            "experts": {"prompt": self.prompt_experts.to_dict(), "decode": self.decode_experts.to_dict()},
        }


    def summary(self) -> str:
        """One log line: tokens and tok/s of each phase, the prompt cache and expert hit rates."""
        return (f"prompt {self.prompt_n + self.cache_n} tokens ({self.cache_n} cached) at "
                f"{_rate(self.prompt_n, self.prompt_ms):.1f} tok/s, generated {self.predicted_n} at "
                f"{_rate(self.predicted_n, self.predicted_ms):.1f} tok/s, expert hit rate "
                f"{self.prompt_experts.to_dict()['hit_rate']:.2f} prompt / "
                f"{self.decode_experts.to_dict()['hit_rate']:.2f} decode"
                + (f", drafts kept {self.draft_n_accepted}/{self.draft_n}" if self.draft_n else ""))


def _rate(n: int, ms: float) -> float:
    return n / ms * 1000.0 if ms > 0 else 0.0


@dataclass
class Finished:
    """The request is done: why (``stop`` or ``length``), token counts, timings, and the stop string
    that ended it (``""`` for an end-of-sequence token or a limit)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    stop_word: str = ""


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
    decode_seconds: float = 0.0  # in decode windows (sampling included)
    prefill_seconds: float = 0.0  # in prompt chunks, finished or not
    windows: int = 0
    draft_tokens: int = 0  # tokens drafted by speculative decoding ...
    accepted_tokens: int = 0  # ... and kept
    paused_windows: int = 0  # a request's windows without drafts, paused after its drafts missed
    steps: int = 0  # steps that ran work: a decode window, prompt chunks or both
    active: int = 0
    waiting: int = 0
