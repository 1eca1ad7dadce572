"""Tool calls for a chat template that knows none: the tools described in a system message, replies
as one JSON object (as llama.cpp's generic tool-call format).

The model is asked to answer with ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` to call
tools, or ``{"response": "..."}`` to answer in text; a forced ``tool_choice`` enforces the first
shape by grammar (``call_schema``). A reply that is such an object gives its calls or its response;
any other reply is content as it is. Earlier turns are given to the template as plain messages: an
assistant's calls as that JSON, a tool's result as a user message naming its call.
"""

from __future__ import annotations

import json
from typing import Any

from strata_core.serving.tool_call import ToolCall, arguments_json, json_object
from strata_core.text.harmony import Piece

__all__ = ["GenericParser", "call_schema", "generic_messages"]


def _tool_entries(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"].get("description") or "",
             "parameters": t["function"].get("parameters") or {"type": "object"}} for t in tools]


def call_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a reply that calls tools (``tools``: name, parameters schema or None for any
    object): ``{"tool_calls": [...]}``, one call unless ``parallel``."""
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                           "arguments": parameters or {"type": "object"}},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for name, parameters in tools]}
    array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def _instructions(tools: list[dict[str, Any]], parallel: bool) -> str:
    many = "one or more calls" if parallel else "exactly one call"
    return ("You can call these tools (JSON schemas of their arguments):\n"
            + json.dumps(_tool_entries(tools), ensure_ascii=False, indent=1)
            + "\n\nTo call tools, reply with only a JSON object: "
            + '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
            + f" ({many} in the list). To answer in text, reply with only "
            + '{"response": "<your answer>"}.')


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     parallel: bool) -> list[dict[str, Any]]:
    """``messages`` (as the chat template reads them) for a template that knows no tools: the tools'
    instructions first in the system message (``tools`` offered), an assistant's calls as the JSON
    reply, a tool's result as a user message."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m["role"] == "tool":
            name = f" ({m['tool_call_id']})" if m.get("tool_call_id") else ""
            out.append({"role": "user", "content": f"Tool result{name}:\n{m['content']}"})
        else:
            out.append(m)
    if tools:
        text = _instructions(tools, parallel)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _reply(value: dict[str, Any]) -> list[Piece | ToolCall] | None:
    """The calls or the response of a reply object, None when it is neither."""
    calls = value.get("tool_calls")
    if isinstance(value.get("tool_call"), dict):
        calls = [value["tool_call"]]
    if isinstance(calls, list) and calls:
        out: list[Piece | ToolCall] = []
        for call in calls:
            name = call.get("name") if isinstance(call, dict) else None
            arguments = arguments_json(call.get("arguments", {})) if isinstance(name, str) and name else None
            if arguments is None:
                return None
            out.append(ToolCall(name, arguments))
        return out
    if isinstance(value.get("response"), str) and len(value) == 1:
        return [Piece("content", value["response"])] if value["response"] else []
    return None


class GenericParser:
    """Replies in the generic format: a reply that starts with ``{`` is held to its end and read as
    the JSON object; any other streams as content."""

    def __init__(self) -> None:
        self._buf = ""
        self._held: bool | None = None  # whether the reply is held (decided at its first non-space)

    def feed(self, text: str) -> list[Piece | ToolCall]:
        """What ``text`` completes: content as it streams, nothing while the reply is held."""
        self._buf += text
        if self._held is None and self._buf.strip():
            self._held = self._buf.lstrip().startswith("{")
        if self._held is False:
            out, self._buf = [Piece("content", self._buf)], ""
            return out
        return []

    def finish(self) -> list[Piece | ToolCall]:
        """The held reply read, or the rest as content."""
        text, self._buf = self._buf, ""
        value = json_object(text) if self._held else None
        parsed = _reply(value) if value is not None else None
        if parsed is not None:
            return parsed
        return [Piece("content", text)] if text else []
