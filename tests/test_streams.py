"""A request's sampled tokens to text and a finish reason (TokenStream), without an engine."""

from __future__ import annotations

from test_server_support import FakeTokenizer

from strata_core.serving.requests import GenerationRequest
from strata_core.serving.sampling import SampleResult, SamplingParams
from strata_core.serving.streams import TokenStream

TOK = FakeTokenizer()


def _push_all(stream: TokenStream, tokens: list[int], full_at: int = -1) -> tuple[str, str, int]:
    """The text given out, the finish reason and how many tokens were taken before it."""
    text = ""
    for i, token in enumerate(tokens):
        delta, reason = stream.push(SampleResult(token), context_full=i == full_at)
        text += delta.text if delta is not None else ""
        if reason:
            return text, reason, i + 1
    return text, "", len(tokens)


def _stream(max_tokens: int | None = None, stop: list[str] | None = None, ignore_eos: bool = False) -> TokenStream:
    params = SamplingParams(max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos)
    return TokenStream(TOK, GenerationRequest([5], params))


def test_end_of_sequence_stops_and_is_not_text() -> None:
    assert _push_all(_stream(), TOK.encode("hello") + [0] + TOK.encode("more")) == ("hello", "stop", 6)


def test_ignore_eos_runs_past_end_tokens_to_max_tokens() -> None:
    tokens = TOK.encode("hi") + [0] + TOK.encode("more")
    text, reason, taken = _push_all(_stream(max_tokens=5, ignore_eos=True), tokens)
    assert (reason, taken) == ("length", 5) and text.startswith("hi") and text.endswith("mo")


def test_max_tokens_and_a_full_context_are_length() -> None:
    assert _push_all(_stream(max_tokens=3), TOK.encode("hello")) == ("hel", "length", 3)
    assert _push_all(_stream(), TOK.encode("hello"), full_at=1) == ("he", "length", 2)


def test_a_stop_string_across_tokens_cuts_the_text_before_it() -> None:
    assert _push_all(_stream(stop=["lo w"]), TOK.encode("hello world")) == ("hel", "stop", 7)


def test_text_held_back_for_a_stop_string_is_given_out_at_the_end() -> None:
    assert _push_all(_stream(max_tokens=4, stop=["llx"]), TOK.encode("hell")) == ("hell", "length", 4)


def test_a_character_split_over_tokens_comes_whole_and_logprobs_come_per_token() -> None:
    stream = _stream()
    first, second = TOK.encode("\u00e9")  # two bytes, two tokens
    delta, reason = stream.push(SampleResult(first, -0.5, ((first, -0.5),)), context_full=False)
    assert delta is not None and delta.text == "" and delta.logprobs[0].logprob == -0.5 and reason == ""
    delta, _ = stream.push(SampleResult(second), context_full=False)
    assert delta is not None and delta.text == "\u00e9" and delta.tokens == [second] and delta.logprobs == []
    assert stream.generated == 2
