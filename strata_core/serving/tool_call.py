"""One tool call a model made, and the JSON helpers every reply format reads its calls with."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "arguments_json", "json_object", "new_call_id"]


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and random hex."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


def json_object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object, None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def arguments_json(value: Any) -> str | None:
    """JSON text of a call's arguments: an object, or a string holding one (as some models write it)."""
    if isinstance(value, str):
        value = json_object(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
