"""Read tool calls out of a chat reply, whole or as it streams, per model family.

Four formats are known, chosen by the chat template (``tool_call_format``):

- "hermes" (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks, one or more; the text outside them is content. White space before a block, and white
  space after one that no text follows, is a separator, not content. Text that may be the start of ``<tool_call>`` is
  held back as it streams, the way stop strings are; a block is given whole once its closing tag
  arrives. A block whose body is not such a JSON object, or one never closed, is content as it is.
- "harmony" (gpt-oss): a message to ``functions.NAME`` whose body is the JSON arguments
  (strata_core.text.harmony);
- "deepseek" (DeepSeek-V3, R1: arguments fenced as JSON) and "deepseek-v3.1" (V3.1 on: bare): a
  section of ``<｜tool▁call▁begin｜>`` calls after the content (strata_core.serving.deepseek_calls; its
  parser reads both layouts, the grammar of a forced call writes the template's);
- "json" (any other template): the tools described in a system message and a reply that is one JSON
  object (strata_core.serving.generic_calls).

``ReplyParser`` turns reply text into ``Piece``s (reasoning, content) and ``ToolCall``s in output
order; any split of the text gives the same calls and the same text as feeding it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from strata_core.serving.deepseek_calls import CALLS_BEGIN, DeepSeekParser
from strata_core.serving.generic_calls import GenericParser
from strata_core.serving.think import ThinkParser
from strata_core.serving.tool_call import ToolCall, arguments_json, json_object, new_call_id
from strata_core.text.harmony import HarmonyParser, Piece, held_prefix, uses_harmony

__all__ = ["HermesParser", "ReplyFormat", "ReplyParser", "ToolCall", "hermes_call", "new_call_id", "parse_reply",
           "tool_call_format"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_call_format(template_source: str) -> str:
    """The tool-call format of replies under a chat template: "harmony", "hermes", "deepseek",
    "deepseek-v3.1", or None (unknown)."""
    if uses_harmony(template_source):
        return "harmony"
    if CALLS_BEGIN in template_source:
        return "deepseek" if "```json" in template_source else "deepseek-v3.1"
    return "hermes" if OPEN in template_source else "json"


def hermes_call(body: str) -> ToolCall | None:
    """The call of a ``<tool_call>`` block's body, None unless it is ``{"name": str, "arguments": {...}}``."""
    value = json_object(body)
    if value is None or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = arguments_json(value.get("arguments", {}))
    return ToolCall(value["name"], arguments) if arguments is not None else None


class HermesParser:
    """Incremental parser of ``<tool_call>`` blocks: ``feed`` text as it streams, ``finish`` at the end."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_block = False
        self._gap = ""  # the white space before the open block: content again if the block is not a call
        self._after_call = False  # no content since the last call: white space at the end is a separator

    def feed(self, text: str) -> list[Piece | ToolCall]:
        """The content and the calls that ``text`` completes."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece | ToolCall]:
        """What is held back, at the end of generation."""
        return self._drain(final=True)

    def _content(self, text: str, out: list[Piece | ToolCall]) -> None:
        if text:
            out.append(Piece("content", text))
            self._after_call = False

    def _not_a_call(self, block: str, out: list[Piece | ToolCall]) -> None:
        self._content(self._gap + block, out)

    def _drain(self, final: bool) -> list[Piece | ToolCall]:
        out: list[Piece | ToolCall] = []
        while self._buf:
            if self._in_block:
                at = self._buf.find(CLOSE)
                if at < 0:
                    if final:  # never closed: content as it is
                        self._not_a_call(OPEN + self._buf, out)
                        self._buf = ""
                    break
                body, self._buf, self._in_block = self._buf[:at], self._buf[at + len(CLOSE):], False
                call = hermes_call(body)
                if call is None:
                    self._not_a_call(OPEN + body + CLOSE, out)
                else:
                    out.append(call)
                    self._after_call = True
                continue
            at = self._buf.find(OPEN)
            if at >= 0:
                before = self._buf[:at].rstrip()
                self._gap = self._buf[len(before):at]
                self._content(before, out)
                self._buf, self._in_block = self._buf[at + len(OPEN):], True
                continue
            # hold what may start a tag, and trailing white space (a separator if a block follows)
            keep = 0 if final else held_prefix(self._buf, OPEN)
            text = self._buf[:len(self._buf) - keep]
            if not final:
                text = text.rstrip()
            elif self._after_call and not text.strip():
                text = ""  # the separator after the last call
            self._content(text, out)
            self._buf = "" if final else self._buf[len(text):]
            break
        return out


class _HarmonyCalls:
    """HarmonyParser with its "tool" pieces made calls (arguments that are not a JSON object: content)."""

    def __init__(self) -> None:
        self._parser = HarmonyParser(tools=True)

    def feed(self, text: str) -> list[Piece | ToolCall]:
        return self._calls(self._parser.feed(text))

    def finish(self) -> list[Piece | ToolCall]:
        return self._calls(self._parser.finish())

    @staticmethod
    def _calls(pieces: list[Piece]) -> list[Piece | ToolCall]:
        out: list[Piece | ToolCall] = []
        for piece in pieces:
            if piece.kind != "tool":
                out.append(piece)
            elif (arguments := arguments_json(piece.text)) is not None:
                out.append(ToolCall(piece.name, arguments))
            elif piece.text:
                out.append(Piece("content", piece.text))
        return out


@dataclass(frozen=True)
class ReplyFormat:
    """How a chat reply is read: harmony channels, a tool-call format (None: no tools were offered),
    at most ``max_calls`` calls kept (None: all), and ``<think>`` reasoning (strata_core.serving.think:
    None, "tags": a reply may open a block, "open": the prompt opened one)."""

    harmony: bool = False
    tools: str | None = None
    max_calls: int | None = None
    think: str | None = None

    def parser(self) -> ReplyParser | None:
        """A fresh parser of one reply; None when the text is all content."""
        if self.harmony:
            return ReplyParser(_HarmonyCalls() if self.tools == "harmony" else HarmonyParser(), self.max_calls)
        inner = self._calls()
        if self.think is not None:
            inner = ThinkParser(inner, self.think == "open")
        return None if inner is None else ReplyParser(inner, self.max_calls)

    def _calls(self) -> _Parser | None:
        """The parser of the reply's tool calls (None: no tools)."""
        if self.tools is None:
            return None
        if self.tools.startswith("deepseek"):
            return DeepSeekParser()
        return GenericParser() if self.tools == "json" else HermesParser()


class _Parser(Protocol):
    def feed(self, text: str) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


class ReplyParser:
    """Pieces and calls of one reply, calls past ``max_calls`` dropped."""

    def __init__(self, inner: _Parser, max_calls: int | None) -> None:
        self._inner = inner
        self._max_calls = max_calls
        self.calls = 0  # calls given so far

    def feed(self, text: str) -> list[Piece | ToolCall]:
        """What ``text`` completes."""
        return self._limit(self._inner.feed(text))

    def finish(self) -> list[Piece | ToolCall]:
        """What is held back, at the end of the reply."""
        return self._limit(self._inner.finish())

    def _limit(self, items: list[Piece | ToolCall]) -> list[Piece | ToolCall]:
        out = []
        for item in items:
            if isinstance(item, ToolCall):
                if self._max_calls is not None and self.calls >= self._max_calls:
                    continue
                self.calls += 1
            out.append(item)
        return out


def parse_reply(text: str, parser: ReplyParser) -> tuple[str, str, list[ToolCall]]:
    """``(reasoning, content, calls)`` of a whole reply."""
    items = parser.feed(text) + parser.finish()
    pieces = [item for item in items if isinstance(item, Piece)]
    return ("".join(p.text for p in pieces if p.kind == "reasoning"),
            "".join(p.text for p in pieces if p.kind == "content"),
            [item for item in items if isinstance(item, ToolCall)])
