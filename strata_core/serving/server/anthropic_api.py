"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), served on the chat
completions' path.

``system`` and ``messages`` become chat messages: ``text`` blocks their content, ``tool_use`` blocks an
assistant message's tool calls (``input`` as the JSON arguments), ``tool_result`` blocks tool messages,
``thinking`` blocks the reasoning of an earlier reply. ``tools`` (``input_schema``) and ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``) map onto the chat ones, ``stop_sequences`` onto ``stop``,
``thinking: {"type": "disabled"}`` onto ``reasoning_effort: "none"``. The reply, read as a chat reply
is, comes back as content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's
``stop_reason``, whole or as the documented stream of events. Errors on these routes have Anthropic's
shape (``{"type": "error", "error": {"type", "message"}}``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import Stream
from msgspec import Meta, Struct

from strata_core.errors import InvalidParamError
from strata_core.serving.requests import Finished
from strata_core.serving.scheduler import RequestHandle
from strata_core.serving.server import schemas as s
from strata_core.serving.server.controllers import respond, until_disconnect
from strata_core.serving.server.errors import error_body, error_headers
from strata_core.serving.server.responses import named_event, new_id, read_reply, reply_items
from strata_core.serving.server.service import GenerationService
from strata_core.serving.stop_strings import MAX_STOPS
from strata_core.serving.tool_calls import ReplyFormat, ToolCall
from strata_core.text.harmony import Piece

__all__ = ["MessagesController", "MessagesRequest", "chat_request"]


# --- the request ------------------------------------------------------------------------------------

class AnthropicTool(Struct, kw_only=True):
    """A client tool (``type`` absent or "custom"); Anthropic's server tools are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(Struct, kw_only=True):
    """The body of ``POST /v1/messages`` and of ``/v1/messages/count_tokens`` (which needs no
    ``max_tokens``); unknown fields are logged, or refused with strict_requests."""

    messages: list[AnthropicMessage]
    model: str | None = None
    max_tokens: s.MaxTokens | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[s.StopString], Meta(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    temperature: s.Temperature | None = None
    top_p: s.TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored (a user id)


class TextBlock(Struct, kw_only=True):
    text: str


class ToolUseBlock(Struct, kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Struct, kw_only=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False


class ThinkingBlock(Struct, kw_only=True):
    thinking: str


_BLOCKS: dict[str, type[Struct]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                                    "thinking": ThinkingBlock}


def _block(raw: dict[str, Any], where: str) -> Struct | None:
    """A content block as its typed struct (None for a ``redacted_thinking`` block, which has no text)."""
    kind = raw.get("type")
    if kind == "redacted_thinking":
        return None
    if kind in ("image", "document"):
        raise InvalidParamError(f"{where}: {kind} input is not supported by this server", where, "unsupported_value")
    if kind not in _BLOCKS:
        raise InvalidParamError(f"{where} has type {kind!r}; supported: {', '.join(_BLOCKS)}", where,
                                "unsupported_value")
    try:
        return msgspec.convert({k: v for k, v in raw.items() if k != "type"}, _BLOCKS[kind])
    except msgspec.ValidationError as exc:
        raise InvalidParamError(f"{where}: {exc}", where) from None


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """The text of a ``system`` or ``tool_result`` content: a string or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for i, raw in enumerate(content):
        block = _block(raw, f"{where}[{i}]")
        if not isinstance(block, TextBlock):
            raise InvalidParamError(f"{where}[{i}] must be a text block", where)
        out.append(block.text)
    return "".join(out)


def _message(message: AnthropicMessage, where: str) -> list[s.ChatMessage]:
    """The chat messages of one Anthropic message: its tool results as tool messages (first, in order),
    then its text, tool calls and reasoning as one message of its role."""
    if isinstance(message.content, str):
        return [s.ChatMessage(role=message.role, content=message.content)]
    out, texts, calls, reasoning = [], [], [], []
    for i, raw in enumerate(message.content):
        block = _block(raw, f"{where}.content[{i}]")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(s.ToolCall(id=block.id, function=s.FunctionCall(block.name, json.dumps(block.input))))
        elif isinstance(block, ToolResultBlock):
            out.append(s.ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                     content=_text(block.content, f"{where}.content[{i}].content")))
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
    if texts or calls or not out:
        out.append(s.ChatMessage(role=message.role, content="".join(texts), tool_calls=calls or None,
                                 reasoning_content="".join(reasoning) or None))
    return out


def _tools(body: MessagesRequest) -> list[s.Tool] | None:
    out = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise InvalidParamError(f"tools[{i}] is the server tool {tool.type!r}, which this server does not have",
                                    f"tools[{i}]", "unsupported_value")
        out.append(s.Tool(type="function", function=s.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema)))
    return out or None


def _tool_choice(choice: AnthropicToolChoice | None) -> str | s.NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not choice.name:
        raise InvalidParamError("tool_choice of type 'tool' needs the tool's name", "tool_choice")
    return s.NamedToolChoice(type="function", function=s.FunctionName(choice.name))


def chat_request(body: MessagesRequest) -> s.ChatCompletionRequest:
    """The chat completion request a Messages request asks for."""
    system = [s.ChatMessage(role="system", content=_text(body.system, "system"))] if body.system else []
    messages = [m for i, message in enumerate(body.messages) for m in _message(message, f"messages[{i}]")]
    no_parallel = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    return s.ChatCompletionRequest(
        model=body.model, messages=system + messages, max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, stop=body.stop_sequences,
        tools=_tools(body), tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=False if no_parallel else None,
        reasoning_effort="none" if body.thinking is not None and body.thinking.type == "disabled" else None,
    )  # fmt: skip


# --- the response -----------------------------------------------------------------------------------

class TextContent(Struct, tag_field="type", tag="text"):
    text: str


class ThinkingContent(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseContent(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(Struct):
    """Tokens of the request: ``input_tokens`` those computed, ``cache_read_input_tokens`` those whose KV
    was reused (together the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageObject(Struct):
    id: str
    model: str
    content: list[TextContent | ThinkingContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class TokenCount(Struct):
    input_tokens: int


def _tool_use(call: ToolCall) -> ToolUseContent:
    return ToolUseContent("toolu_" + call.id.removeprefix("call_"), call.name, json.loads(call.arguments))


def _usage(end: Finished) -> MessageUsage:
    return MessageUsage(end.prompt_tokens - end.timings.cache_n, end.completion_tokens, end.timings.cache_n)


def stop_reason(end: Finished, calls: int) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished reply with ``calls`` tool calls."""
    if end.reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    return ("stop_sequence", end.stop_word) if end.stop_word else ("end_turn", None)


def message_object(model: str, text: str, end: Finished, fmt: ReplyFormat) -> MessageObject:
    """The whole message of a finished generation."""
    reasoning, content, calls = read_reply(text, fmt)
    blocks: list[TextContent | ThinkingContent | ToolUseContent] = [ThinkingContent(reasoning)] if reasoning else []
    if content or not calls:
        blocks.append(TextContent(content))
    blocks += [_tool_use(call) for call in calls]
    return MessageObject(new_id("msg", "_"), model, blocks, *stop_reason(end, len(calls)), _usage(end))


async def message_stream(model: str, handle: RequestHandle, fmt: ReplyFormat) -> AsyncIterator[bytes]:
    """The documented events of a streamed message: ``message_start``; per content block
    ``content_block_start``, its ``content_block_delta``s (``text_delta``, ``thinking_delta``, or a tool
    call's ``input_json_delta``) and ``content_block_stop``; ``message_delta`` with the stop reason and
    usage; ``message_stop``. A failure after the start is an ``error`` event."""
    blocks = 0  # blocks started
    open_kind: str | None = None  # "text" or "thinking": the block whose text is streaming
    calls = 0

    def event(kind: str, **fields: Any) -> bytes:
        return named_event(kind, {"type": kind, **fields})

    def close() -> list[bytes]:
        nonlocal open_kind
        out = [event("content_block_stop", index=blocks - 1)] if open_kind is not None else []
        open_kind = None
        return out

    def start(block: Struct) -> bytes:
        nonlocal blocks
        blocks += 1
        return event("content_block_start", index=blocks - 1, content_block=block)

    def add(item: Piece | ToolCall) -> list[bytes]:
        nonlocal open_kind, calls
        if isinstance(item, ToolCall):
            calls += 1
            use = _tool_use(item)
            return [*close(), start(ToolUseContent(use.id, use.name, {})),
                    event("content_block_delta", index=blocks - 1,
                          delta={"type": "input_json_delta", "partial_json": item.arguments}),
                    event("content_block_stop", index=blocks - 1)]
        if not item.text:
            return []
        kind = "thinking" if item.kind == "reasoning" else "text"
        out = [] if open_kind == kind else close()
        if open_kind is None:
            out.append(start(ThinkingContent("") if kind == "thinking" else TextContent("")))
            open_kind = kind
        delta = {"type": "thinking_delta", "thinking": item.text} if kind == "thinking" else \
            {"type": "text_delta", "text": item.text}
        return [*out, event("content_block_delta", index=blocks - 1, delta=delta)]

    head = MessageObject(new_id("msg", "_"), model, [], None, None, MessageUsage(handle.prompt_tokens, 0))
    yield event("message_start", message=head)
    try:
        async with contextlib.aclosing(reply_items(handle, fmt)) as items:
            async for item in items:
                if not isinstance(item, Finished):
                    for chunk in add(item):
                        yield chunk
                    continue
                if not blocks:  # an empty reply is still one (empty) text block
                    yield start(TextContent(""))
                    open_kind = "text"
                for chunk in close():
                    yield chunk
                reason, sequence = stop_reason(item, calls)
                yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage=_usage(item))
                yield event("message_stop")
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        status, body = error_body(exc)
        yield event("error", error={"type": error_type(status), "message": body.error.message})


# --- errors -----------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def handle_exception(_: Request, exc: Exception) -> Response[dict[str, Any]]:
    """The exception handler of the Anthropic routes: the server's status, Anthropic's error body."""
    status, body = error_body(exc)
    return Response({"type": "error", "error": {"type": error_type(status), "message": body.error.message}},
                    status_code=status, headers=error_headers(status))


class MessagesController(Controller):
    """``/v1/messages`` and ``/v1/messages/count_tokens``."""

    path = "/messages"
    tags = ["anthropic"]
    exception_handlers = {Exception: handle_exception}

    @post(operation_id="createMessage", status_code=200,
          summary="Anthropic's Messages API: the next message of a conversation (events with stream=true)")
    async def create(self, request: Request, data: JSONBody[MessagesRequest],
                     service: NamedDependency[GenerationService]) -> MessageObject | Stream:
        service.check_fields(s.unknown_fields(await request.body(), MessagesRequest))
        if data.max_tokens is None:
            raise InvalidParamError("max_tokens is required", "max_tokens")
        chat = chat_request(data)
        handle = await until_disconnect(request, service.chat(chat))
        fmt = service.reply_format(chat, handle)
        chunks = message_stream(service.model_id, handle, fmt) if data.stream else None
        return await respond(request, handle, chunks, lambda out: message_object(service.model_id, out.text, out.end, fmt))

    @post("/count_tokens", operation_id="countMessageTokens", status_code=200,
          summary="The prompt tokens a Messages request renders to")
    async def count_tokens(self, request: Request, data: JSONBody[MessagesRequest],
                           service: NamedDependency[GenerationService]) -> TokenCount:
        service.check_fields(s.unknown_fields(await request.body(), MessagesRequest))
        service.check_model(data.model)
        text = await until_disconnect(request, service.render(chat_request(data)))
        return TokenCount(len(await service.tokenize(text, True, "messages")))
