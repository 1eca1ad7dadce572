"""OpenAI's Responses API (``POST /v1/responses``), served on the chat completions' path.

A request's ``instructions`` and ``input`` (a string, or a list of messages and items) become chat
messages: ``function_call`` items the tool calls of an assistant message, ``function_call_output``
items tool messages, ``reasoning`` items the next assistant message's reasoning. Function ``tools``
and ``tool_choice`` map onto the chat ones, ``max_output_tokens`` onto ``max_tokens``,
``reasoning.effort`` onto ``reasoning_effort`` and ``text.format`` onto ``response_format``. The reply,
read as a chat reply is, comes back as ``output`` items (``reasoning``, ``message``,
``function_call``), whole or as the documented stream of events. Nothing is stored, so
``previous_response_id`` and item references are refused.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import Stream
from msgspec import Struct

from strata_core.errors import InvalidParamError
from strata_core.serving.requests import Finished
from strata_core.serving.scheduler import RequestHandle
from strata_core.serving.server import schemas as s
from strata_core.serving.server.controllers import respond, until_disconnect
from strata_core.serving.server.errors import error_body
from strata_core.serving.server.responses import named_event, new_id, read_reply, reply_items, timings
from strata_core.serving.server.service import GenerationService
from strata_core.serving.tool_calls import ReplyFormat, ToolCall
from strata_core.text.harmony import Piece

__all__ = ["ResponsesController", "ResponsesRequest", "chat_request"]


# --- the request ------------------------------------------------------------------------------------

class FunctionTool(Struct, kw_only=True):
    """A tool of the request; only ``function`` tools are served."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True):
    type: str = "text"  # "text", "json_object" or "json_schema"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(Struct, kw_only=True):
    """The body of ``POST /v1/responses`` (unknown fields are logged, or refused with strict_requests)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: s.MaxTokens | None = None
    temperature: s.Temperature | None = None
    top_p: s.TopP | None = None
    stream: bool = False
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None


class MessageItem(Struct, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Struct, kw_only=True):
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(Struct, kw_only=True):
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


_ITEMS: dict[str, type[Struct]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                   "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _item(raw: dict[str, Any], where: str) -> Struct:
    """An input item as its typed struct (an item without ``type`` is a message)."""
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise InvalidParamError(f"{where} is an item_reference, but this server stores no items: send the item "
                                "itself", where, "unsupported_value")
    if kind not in _ITEMS:
        raise InvalidParamError(f"{where} has type {kind!r}; supported: {', '.join(_ITEMS)}", where,
                                "unsupported_value")
    try:
        return msgspec.convert({k: v for k, v in raw.items() if k != "type"}, _ITEMS[kind])
    except msgspec.ValidationError as exc:
        raise InvalidParamError(f"{where}: {exc}", where) from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a content string or list of text parts (anything else, such as an image, is refused)."""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidParamError(f"{where}.content[{i}] has type {part.get('type')!r}: only text parts are "
                                    "supported (image and file input are not)", where, "unsupported_value")
        out.append(part["text"])
    return "".join(out)


def chat_messages(body: ResponsesRequest) -> list[s.ChatMessage]:
    """The chat messages of a request's ``instructions`` and ``input``: consecutive function calls join
    the assistant message before them, a reasoning item goes to the next assistant message."""
    out = [s.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*out, s.ChatMessage(role="user", content=body.input)]
    reasoning: str | None = None
    for i, raw in enumerate(body.input):
        where = f"input[{i}]"
        item = _item(raw, where)
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + _text(item.content or item.summary, where)
        elif isinstance(item, MessageItem):
            out.append(s.ChatMessage(role=item.role, content=_text(item.content, where),
                                     reasoning_content=reasoning if item.role == "assistant" else None))
            reasoning = None if item.role == "assistant" else reasoning
        elif isinstance(item, FunctionCallItem):
            call = s.ToolCall(id=item.call_id, function=s.FunctionCall(item.name, item.arguments))
            if out and out[-1].role == "assistant" and reasoning is None:
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(s.ChatMessage(role="assistant", tool_calls=[call], reasoning_content=reasoning))
                reasoning = None
        else:
            assert isinstance(item, FunctionCallOutputItem)
            out.append(s.ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output, where)))
    return out


def _tools(body: ResponsesRequest) -> list[s.Tool] | None:
    out = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function" or not tool.name:
            raise InvalidParamError(f"tools[{i}] has type {tool.type!r}: only function tools with a name are "
                                    "supported", f"tools[{i}]", "unsupported_value")
        out.append(s.Tool(type="function", function=s.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    return out or None


def _response_format(text: TextConfig | None) -> s.ResponseFormat | None:
    """``text.format`` as the chat request's ``response_format`` (None for plain text)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type != "json_schema":
        return s.ResponseFormat(type=fmt.type)
    schema = {"name": fmt.name, "schema": fmt.schema, "description": fmt.description, "strict": fmt.strict}
    return s.ResponseFormat(type=fmt.type, json_schema={k: v for k, v in schema.items() if v is not None})


def chat_request(body: ResponsesRequest) -> s.ChatCompletionRequest:
    """The chat completion request a Responses request asks for."""
    if body.previous_response_id is not None:
        raise InvalidParamError("previous_response_id is not supported: this server stores no responses; send the "
                                "whole conversation as input", "previous_response_id", "unsupported_value")
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = s.NamedToolChoice(type="function", function=s.FunctionName(choice.name))
    return s.ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, tools=_tools(body), tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls, response_format=_response_format(body.text),
        reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
    )  # fmt: skip


# --- the response -----------------------------------------------------------------------------------

class OutputText(Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class MessageOutput(Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: Literal["assistant"] = "assistant"


class ReasoningOutput(Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = []
    status: str = "completed"


class FunctionCallOutput(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class IncompleteDetails(Struct):
    reason: str


class ResponseObject(Struct):
    """A response (``object: "response"``): whole, or the snapshot a stream's lifecycle event carries."""

    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    object: Literal["response"] = "response"
    error: None = None
    previous_response_id: None = None
    store: bool = False
    metadata: dict[str, str] = {}
    truncation: str = "disabled"


class _Head:
    """What every snapshot of one response repeats: its id, creation time, model and request settings."""

    def __init__(self, model: str, body: ResponsesRequest, chat: s.ChatCompletionRequest) -> None:
        self.id, self.created, self.model, self.body, self.chat = new_id("resp", "_"), int(time.time()), model, body, chat

    def snapshot(self, output: list[OutputItem], end: Finished | None = None) -> ResponseObject:
        """The response holding ``output``: in progress, or finished with ``end``."""
        status, details, used = "in_progress", None, None
        if end is not None:
            status = "incomplete" if end.reason == "length" else "completed"
            details = IncompleteDetails("max_output_tokens") if end.reason == "length" else None
            used = ResponseUsage(end.prompt_tokens, end.completion_tokens, end.prompt_tokens + end.completion_tokens,
                                 {"cached_tokens": end.timings.cache_n}, {"reasoning_tokens": 0})
        return ResponseObject(
            self.id, self.created, self.model, status, output, used, details, self.body.instructions,
            self.body.max_output_tokens, self.chat.temperature, self.chat.top_p,
            msgspec.to_builtins(self.body.tools or []), msgspec.to_builtins(self.body.tool_choice or "auto"),
            self.body.parallel_tool_calls is not False,
        )  # fmt: skip


def _call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> FunctionCallOutput:
    return FunctionCallOutput("fc_" + call.id.removeprefix("call_"), call.id, call.name,
                              call.arguments if arguments is None else arguments, status)


def response_object(head: _Head, text: str, end: Finished, fmt: ReplyFormat) -> ResponseObject:
    """The whole response of a finished generation."""
    reasoning, content, calls = read_reply(text, fmt)
    output: list[OutputItem] = []
    if reasoning:
        output.append(ReasoningOutput(new_id("rs", "_"), [ReasoningText(reasoning)]))
    if content or not calls:
        output.append(MessageOutput(new_id("msg", "_"), [OutputText(content)]))
    output += [_call_item(call) for call in calls]
    return head.snapshot(output, end)


async def response_stream(head: _Head, handle: RequestHandle, fmt: ReplyFormat) -> AsyncIterator[bytes]:
    """The documented events of a streamed response: ``response.created`` and ``.in_progress``; per
    output item ``.output_item.added``, its text as ``.content_part.added`` / ``.output_text.delta`` (or
    ``.reasoning_text.delta``) / ``.output_text.done`` / ``.content_part.done``, or a tool call's
    ``.function_call_arguments.delta`` / ``.done``, then ``.output_item.done``; last
    ``response.completed`` (``response.incomplete`` when cut by max_output_tokens) with the usage and
    llama-server's ``timings``. A failure after the start is an ``error`` event."""
    seq = itertools.count()
    output: list[OutputItem] = []
    text: MessageOutput | ReasoningOutput | None = None  # the item whose text is streaming

    def event(kind: str, **fields: Any) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(seq), **fields})

    def part_events(item: MessageOutput | ReasoningOutput, kind: str) -> list[bytes]:
        part = item.content[0]
        where = {"item_id": item.id, "output_index": len(output) - 1, "content_index": 0}
        name = "output_text" if isinstance(item, MessageOutput) else "reasoning_text"
        if kind == "added":
            empty = type(part)("")
            return [event("response.output_item.added", output_index=where["output_index"],
                          item=msgspec.structs.replace(item, content=[], status="in_progress")),
                    event("response.content_part.added", **where, part=empty)]
        extra = {"logprobs": []} if name == "output_text" else {}
        return [event(f"response.{name}.done", **where, text=part.text, **extra),
                event("response.content_part.done", **where, part=part),
                event("response.output_item.done", output_index=where["output_index"], item=item)]

    def close_text() -> list[bytes]:
        nonlocal text
        out = part_events(text, "done") if text is not None else []
        text = None
        return out

    def open_text(cls: type[MessageOutput] | type[ReasoningOutput]) -> list[bytes]:
        nonlocal text
        reasoning = cls is ReasoningOutput
        text = cls(new_id("rs" if reasoning else "msg", "_"), [(ReasoningText if reasoning else OutputText)("")])
        output.append(text)
        return part_events(text, "added")

    def add(item: Piece | ToolCall) -> list[bytes]:
        nonlocal text
        if isinstance(item, ToolCall):
            out = close_text()
            output.append(_call_item(item))
            index, item_id = len(output) - 1, output[-1].id
            return [*out, event("response.output_item.added", output_index=index,
                                item=_call_item(item, "in_progress", "")),
                    event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                          delta=item.arguments),
                    event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          name=item.name, arguments=item.arguments),
                    event("response.output_item.done", output_index=index, item=output[-1])]
        if not item.text:
            return []
        cls = ReasoningOutput if item.kind == "reasoning" else MessageOutput
        out = [] if isinstance(text, cls) else close_text()
        if text is None:
            out += open_text(cls)
        assert text is not None
        text.content[0].text += item.text
        name = "reasoning_text" if cls is ReasoningOutput else "output_text"
        extra = {"logprobs": []} if cls is MessageOutput else {}
        return [*out, event(f"response.{name}.delta", item_id=text.id, output_index=len(output) - 1, content_index=0,
                            delta=item.text, **extra)]

    yield event("response.created", response=head.snapshot([]))
    yield event("response.in_progress", response=head.snapshot([]))
    try:
        async with contextlib.aclosing(reply_items(handle, fmt)) as items:
            async for item in items:
                if isinstance(item, Finished):
                    # an empty reply is still one (empty) message
                    for chunk in close_text() if output else open_text(MessageOutput) + close_text():
                        yield chunk
                    final = head.snapshot(output, item)
                    kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
                    yield event(kind, response=final, timings=timings(item))
                else:
                    for chunk in add(item):
                        yield chunk
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        detail = error_body(exc)[1].error
        yield event("error", code=detail.code, message=detail.message, param=detail.param)


class ResponsesController(Controller):
    """``/v1/responses``."""

    path = "/responses"
    tags = ["responses"]

    @post(operation_id="createResponse", status_code=200,
          summary="OpenAI's Responses API: the next output of a conversation (events with stream=true)")
    async def create(self, request: Request, data: JSONBody[ResponsesRequest],
                     service: NamedDependency[GenerationService]) -> ResponseObject | Stream:
        service.check_fields(s.unknown_fields(await request.body(), ResponsesRequest))
        chat = chat_request(data)
        handle = await until_disconnect(request, service.chat(chat))
        fmt, head = service.reply_format(chat, handle), _Head(service.model_id, data, chat)
        chunks = response_stream(head, handle, fmt) if data.stream else None
        return await respond(request, handle, chunks, lambda out: response_object(head, out.text, out.end, fmt))
