"""Which grammar a request's output must follow, from its fields.

A forced tool call (``tool_choice`` "required" or a named function) is the tool-call grammar of the
model family; else at most one of ``response_format`` (``json_object``, ``json_schema``),
llama-server's ``json_schema`` and ``grammar`` (GBNF); else, when a tool the reply may call is marked
``strict``, free text with every call valid for its tool (``strict_tools_grammar``; other tools' arguments
any object); else the server's default (``--json-schema``, ``--grammar-file``); else none.
"""

from __future__ import annotations

from typing import Any

from strata_core.errors import InvalidParamError
from strata_core.serving.grammar import gbnf_grammar, json_schema_grammar, strict_tools_grammar, tool_call_grammar
from strata_core.serving.server.schemas import ChatCompletionRequest, NamedToolChoice

__all__ = ["request_grammar"]

ANY_OBJECT = {"type": "object"}


def _forced_tools(body: ChatCompletionRequest) -> list[tuple[str, dict[str, Any] | None]]:
    """The tools a reply must call one of (name, parameters schema): none unless ``tool_choice`` forces a call."""
    choice, tools = body.tool_choice, body.tools or []
    if isinstance(choice, NamedToolChoice):
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    elif choice != "required":
        return []
    return [(tool.function.name, tool.function.parameters) for tool in tools]


def _strict_tools(body: ChatCompletionRequest) -> list[tuple[str, dict[str, Any] | None]]:
    """The tools of an unforced reply (name, schema; None for one not marked ``strict``), none unless one
    of them is ``strict``."""
    tools = body.tools or []
    if body.tool_choice == "none" or not any(tool.function.strict for tool in tools):
        return []
    return [(tool.function.name, tool.function.parameters if tool.function.strict else None) for tool in tools]


def _response_format_schema(body: Any) -> Any:
    """The schema ``response_format`` asks for (``json_object``: any object, or llama-server's ``schema``)."""
    rf = body.response_format
    if rf.type == "json_object":
        return rf.schema if rf.schema is not None else ANY_OBJECT
    if rf.json_schema is None:
        raise InvalidParamError("response_format json_schema needs its json_schema object", "response_format")
    return rf.json_schema.get("schema", ANY_OBJECT)


def request_grammar(body: Any, call_format: str | None, default: tuple[str, str] | None,
                    think: str | None = None) -> tuple[str, str] | None:
    """The llguidance grammar ``body`` asks for and the field it comes from, None for free text;
    ``call_format`` is the model's tool-call format, ``default`` the server's grammar, ``think`` the
    reply's ``<think>`` reasoning (``ReplyFormat.think``: a forced call may come after it).
    InvalidParamError for two constraints at once or one that is not valid."""
    tools = _forced_tools(body) if isinstance(body, ChatCompletionRequest) else []
    if tools and call_format is not None:
        return tool_call_grammar(call_format, tools, body.parallel_tool_calls is not False, think), "tool_choice"
    asked = [name for name in ("response_format", "json_schema", "grammar") if getattr(body, name) is not None]
    if "response_format" in asked and body.response_format.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise InvalidParamError(f"{' and '.join(asked)} are set: a request takes one of them", asked[1])
    if not asked:
        strict = _strict_tools(body) if isinstance(body, ChatCompletionRequest) and call_format is not None else []
        grammar = strict_tools_grammar(call_format, strict, body.parallel_tool_calls is not False) if strict else None
        return (grammar, "tools") if grammar is not None else default
    name = asked[0]
    if name == "grammar":
        return gbnf_grammar(body.grammar, name), name
    schema = _response_format_schema(body) if name == "response_format" else body.json_schema
    return json_schema_grammar(schema, name), name
