"""The service side of a request: its sampled token ids turned into text and events.

A :class:`TokenStream` takes each token sampled for one request and gives out the text it completes
(through the tokenizer's stream decoder, cut before a stop string) with its log-probabilities, and
says when the request is done: an end-of-sequence token, a stop string or a complete grammar
(``stop``), ``max_tokens`` or a full context (``length``). It knows nothing of slots, sessions or the engine.
"""

from __future__ import annotations

from typing import Any

from strata_core.serving.requests import Delta, GenerationRequest, TokenLogprob
from strata_core.serving.sampling import SampleResult
from strata_core.serving.stop_strings import StopMatcher

__all__ = ["TokenStream"]


class TokenStream:
    """One request's sampled tokens, as Deltas and a finish reason."""

    def __init__(self, tokenizer: Any, request: GenerationRequest) -> None:
        self._tokenizer = tokenizer
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=not request.keep_special_tokens)
        self._stop = StopMatcher(request.params.stop)
        self._limit = request.params.max_tokens
        self._ends = frozenset() if request.params.ignore_eos else frozenset(tokenizer.eos_token_ids)
        self.generated = 0

    def push(self, result: SampleResult, context_full: bool) -> tuple[Delta | None, str]:
        """Take one sampled token; ``context_full``: no room is left to feed it back.

        :return: the Delta it gives out (None when the decoder and the stop matcher hold all of it
            back), and the finish reason: ``""`` while the request goes on, else ``stop`` or ``length``.
        """
        token = result.token
        self.generated += 1
        eos = token in self._ends
        text, stopped = self._stop.push("" if eos else self._decoder.push(token))
        full = (self._limit is not None and self.generated >= self._limit) or context_full
        reason = "stop" if eos or stopped or result.complete else "length" if full else ""
        if reason and not stopped:  # give out what the decoder and the stop matcher hold back
            tail, stopped = self._stop.push(self._decoder.flush())
            text += tail if stopped else tail + self._stop.held
            reason = "stop" if stopped else reason
        logprobs = [] if result.logprob is None else [self._logprob(result)]
        return (Delta(text, [token], logprobs) if text or logprobs else None), reason

    @property
    def stop_word(self) -> str:
        """The stop string that ended the request (``""``: none did)."""
        return self._stop.found

    def _logprob(self, result: SampleResult) -> TokenLogprob:
        decode = self._tokenizer.decode
        alts = [(i, decode([i]), v) for i, v in result.top_logprobs]
        return TokenLogprob(result.token, decode([result.token]), float(result.logprob), alts)
