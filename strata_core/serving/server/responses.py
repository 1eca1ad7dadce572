"""Build OpenAI response bodies and server-sent event streams from scheduler events."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from litestar import Request

from strata_core.text.harmony import Piece
from strata_core.serving.requests import Delta, Finished, TokenLogprob
from strata_core.serving.scheduler import RequestHandle
from strata_core.serving.server import schemas as s
from strata_core.serving.server.errors import error_body
from strata_core.serving.tool_calls import ReplyFormat, ToolCall, parse_reply

@dataclass
class Collected:
    """A whole generation: its text, logprobs and end."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    end: Finished | None = None


async def collect(handle: RequestHandle) -> Collected:
    """Wait for the whole generation."""
    out = Collected()
    async for event in handle:
        if isinstance(event, Delta):
            out.text += event.text
            out.logprobs += event.logprobs
        else:
            out.end = event
    return out


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, handle: RequestHandle) -> AsyncIterator[None]:
    """Cancel ``handle`` if the client goes away before the body is sent."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        handle.cancel()

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def new_id(prefix: str, sep: str = "-") -> str:
    """An OpenAI-style object id (``sep`` "_" for the Responses and Anthropic APIs' ids: ``resp_...``)."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def usage(end: Finished) -> s.Usage:
    """The ``usage`` object of a finished request."""
    return s.Usage(end.prompt_tokens, end.completion_tokens, end.prompt_tokens + end.completion_tokens,
                   {"cached_tokens": end.timings.cache_n})


def timings(end: Finished) -> s.Timings:
    """The llama-server ``timings`` object of a finished request."""
    values = end.timings.to_dict()
    experts = values.pop("experts")
    return s.Timings(**values, experts=s.ExpertTimings(
        prompt=s.ExpertUsage(**experts["prompt"]), decode=s.ExpertUsage(**experts["decode"])))


def chat_logprobs(items: list[TokenLogprob]) -> s.ChatLogprobs:
    """Logprobs in the chat completions format."""
    return s.ChatLogprobs([
        s.ChatTokenLogprob(lp.text, lp.logprob, list(lp.text.encode()),
                           [s.TopLogprob(t, v, list(t.encode())) for _, t, v in lp.top])
        for lp in items
    ])  # fmt: skip


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> s.CompletionLogprobs:
    """Logprobs in the legacy completions format; ``offset`` is the text length before them."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.text)
    return s.CompletionLogprobs(
        [lp.text for lp in items], [lp.logprob for lp in items],
        [{t: v for _, t, v in lp.top} for lp in items], offsets,
    )  # fmt: skip


def _tool_call(call: ToolCall) -> s.ToolCall:
    return s.ToolCall(id=call.id, function=s.FunctionCall(call.name, call.arguments))


def _finish_reason(reason: str, calls: int) -> str:
    """A reply that ended (not cut by max_tokens) after tool calls finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def read_reply(text: str, fmt: ReplyFormat) -> tuple[str, str, list[ToolCall]]:
    """``(reasoning, content, calls)`` of a whole reply read as ``fmt`` says (all content when there is
    nothing to parse)."""
    parser = fmt.parser()
    return ("", text, []) if parser is None else parse_reply(text, parser)


async def reply_items(handle: RequestHandle, fmt: ReplyFormat) -> AsyncIterator[Piece | ToolCall | Finished]:
    """A reply as it streams, read as ``fmt`` says: its pieces (content, reasoning) and whole tool calls
    in output order, then its Finished; the request is cancelled if the consumer stops early."""
    parser = fmt.parser()
    try:
        async for event in handle:
            if isinstance(event, Finished):
                for item in parser.finish() if parser is not None else []:
                    yield item
                yield event
            elif parser is None:
                if event.text:
                    yield Piece("content", event.text)
            else:
                for item in parser.feed(event.text):
                    yield item
    finally:
        handle.cancel()  # a no-op after Finished; frees the slot when the client went away


def chat_completion(model: str, out: Collected, logprobs: bool, fmt: ReplyFormat = ReplyFormat()) -> s.ChatCompletion:
    """A non-streamed chat completion: a harmony reply's analysis channel is its ``reasoning_content``;
    tool calls are ``tool_calls`` (the content then None when empty)."""
    assert out.end is not None
    reasoning, content, calls = read_reply(out.text, fmt)
    message = s.AssistantMessage(None if calls and not content else content,
                                 reasoning_content=reasoning or msgspec.UNSET,
                                 tool_calls=[_tool_call(c) for c in calls] or msgspec.UNSET)
    choice = s.ChatChoice(0, message, _finish_reason(out.end.reason, len(calls)),
                          chat_logprobs(out.logprobs) if logprobs else None)
    return s.ChatCompletion(new_id("chatcmpl"), int(time.time()), model, [choice], usage=usage(out.end),
                            timings=timings(out.end))


def completion(model: str, out: Collected, logprobs: bool) -> s.Completion:
    """A non-streamed text completion."""
    assert out.end is not None
    choice = s.CompletionChoice(0, out.text, out.end.reason, completion_logprobs(out.logprobs) if logprobs else None)
    return s.Completion(new_id("cmpl"), int(time.time()), model, [choice], usage=usage(out.end), timings=timings(out.end))


def named_event(name: str, payload: object) -> bytes:
    """One server-sent event with an ``event:`` line, as the Responses and Anthropic streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


def _sse(payload: msgspec.Struct | bytes) -> bytes:
    data = payload if isinstance(payload, bytes) else s.encode(payload)
    return b"data: " + data + b"\n\n"


async def _events(handle: RequestHandle, first: Callable[[], bytes | None],
                  delta: Callable[[Delta], list[bytes]], last: Callable[[Finished], list[bytes]],
                  done: bool = True) -> AsyncIterator[bytes]:
    """SSE bytes of a generation, ended by ``[DONE]`` if ``done``; an error after the start becomes an
    error event."""
    try:
        head = first()
        if head:
            yield head
        async for event in handle:
            for chunk in delta(event) if isinstance(event, Delta) else last(event):
                yield chunk
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        yield _sse(s.encode(error_body(exc)[1]))
    finally:
        handle.cancel()  # a no-op after Finished; frees the slot when the client went away
    if done:
        yield b"data: [DONE]\n\n"


def _item_delta(item: Piece | ToolCall, index: int) -> s.ChatDelta:
    """The delta of a reply's piece, or of its tool call number ``index``."""
    if isinstance(item, ToolCall):
        return s.ChatDelta(tool_calls=[s.ToolCallDelta(index=index, id=item.id,
                                                       function=s.FunctionCall(item.name, item.arguments))])
    return s.ChatDelta(reasoning_content=item.text) if item.kind == "reasoning" else s.ChatDelta(content=item.text)


def chat_stream(model: str, handle: RequestHandle, body: s.ChatCompletionRequest,
                fmt: ReplyFormat = ReplyFormat()) -> AsyncIterator[bytes]:
    """The SSE stream of a chat completion: a first chunk whose delta is the role, content null (as
    llama-server sends it), then the text; a harmony reply's text is split as it streams into
    ``reasoning_content`` and ``content`` deltas, and a tool call is one ``tool_calls`` delta once it
    is whole (one chunk each; a delta of header tokens, or of text held back, alone sends nothing, or
    an empty delta with its logprobs). The usage chunk also carries ``timings``, as llama-server's does."""
    cid, created = new_id("chatcmpl"), int(time.time())
    parser = fmt.parser()
    calls = 0  # tool calls sent

    def chunk(delta: s.ChatDelta | s.ChatRoleDelta, reason: str | None = None, lps: list[TokenLogprob] | None = None,
              end: Finished | None = None) -> bytes:
        choice = s.ChatChunkChoice(0, delta, reason, chat_logprobs(lps) if body.logprobs and lps else None)
        return _sse(s.ChatCompletionChunk(cid, created, model, [choice],
                                          timings=timings(end) if end else msgspec.UNSET))

    def delta(d: Delta) -> list[bytes]:
        if parser is None:
            return [chunk(s.ChatDelta(content=d.text), lps=d.logprobs)]
        deltas = _deltas(parser.feed(d.text))
        if not deltas and not (body.logprobs and d.logprobs):
            return []
        deltas = deltas or [s.ChatDelta()]
        return [chunk(deltas[0], lps=d.logprobs)] + [chunk(x) for x in deltas[1:]]

    def _deltas(items: list[Piece | ToolCall]) -> list[s.ChatDelta]:
        nonlocal calls
        out = []
        for item in items:
            out.append(_item_delta(item, calls))
            calls += isinstance(item, ToolCall)
        return out

    def last(end: Finished) -> list[bytes]:
        out = [chunk(x) for x in _deltas(parser.finish())] if parser is not None else []
        out.append(chunk(s.ChatDelta(), _finish_reason(end.reason, calls), end=end))
        if body.stream_options and body.stream_options.include_usage:
            out.append(_sse(s.ChatCompletionChunk(cid, created, model, [], usage=usage(end), timings=timings(end))))
        return out

    return _events(handle, lambda: chunk(s.ChatRoleDelta()), delta, last)


def completion_stream(model: str, handle: RequestHandle, body: s.CompletionRequest) -> AsyncIterator[bytes]:
    """The SSE stream of a text completion (its usage chunk also carries ``timings``)."""
    cid, created = new_id("cmpl"), int(time.time())
    offset = 0

    def delta(d: Delta) -> list[bytes]:
        nonlocal offset
        lps = completion_logprobs(d.logprobs, offset) if body.logprobs is not None else None
        offset += len(d.text)
        return [_sse(s.Completion(cid, created, model, [s.CompletionChoice(0, d.text, None, lps)]))]

    def last(end: Finished) -> list[bytes]:
        out = [_sse(s.Completion(cid, created, model, [s.CompletionChoice(0, "", end.reason)], timings=timings(end)))]
        if body.stream_options and body.stream_options.include_usage:
            out.append(_sse(s.Completion(cid, created, model, [], usage=usage(end), timings=timings(end))))
        return out

    return _events(handle, lambda: None, delta, last)


def token_probabilities(items: list[TokenLogprob]) -> list[s.TokenProbability]:
    """Logprobs in llama-server's ``completion_probabilities`` format."""
    return [s.TokenProbability(lp.token, lp.text, lp.logprob, list(lp.text.encode()),
                               [s.TopTokenProbability(i, t, v, list(t.encode())) for i, t, v in lp.top])
            for lp in items]  # fmt: skip


def _stop_type(end: Finished) -> str:
    return "limit" if end.reason == "length" else "word" if end.stop_word else "eos"


def llama_completion(model: str, content: str, end: Finished, settings: s.LlamaParams,
                     logprobs: list[TokenLogprob] | None = None) -> s.LlamaCompletion:
    """llama-server's ``/completion`` answer (``content`` the text, or ``""`` ending a stream), with
    ``completion_probabilities`` when ``logprobs`` are given."""
    probs = token_probabilities(logprobs) if logprobs is not None else msgspec.UNSET
    return s.LlamaCompletion(content, model, end.completion_tokens, end.prompt_tokens, _stop_type(end),
                             end.stop_word, timings(end), settings, completion_probabilities=probs)


def llama_completion_stream(model: str, handle: RequestHandle, settings: s.LlamaParams) -> AsyncIterator[bytes]:
    """The SSE stream of a ``/completion``: ``{"content", "stop": false}`` events, then the answer with
    ``stop`` true, empty content, and the timings; no ``[DONE]`` (llama-server's native streams end
    without it)."""

    def delta(d: Delta) -> list[bytes]:
        probs = token_probabilities(d.logprobs) if settings.n_probs else msgspec.UNSET
        return [_sse(s.LlamaCompletionChunk(d.text, completion_probabilities=probs))]

    return _events(handle, lambda: None, delta, lambda end: [_sse(llama_completion(model, "", end, settings))],
                   done=False)
