"""DeepSeek-V3's tool calls, read out of a reply whole or as it streams.

The reply's calls follow its content in one section of special tokens:
``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>`` BODY ``<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``. BODY is ``function<｜tool▁sep｜>NAME`` and the arguments in a fenced JSON
block (````` ```json ````` ... ````` ``` `````; DeepSeek-V3 and R1), or ``NAME<｜tool▁sep｜>ARGUMENTS`` (V3.1
and later). A call whose body is neither, with arguments that are not a JSON object, is content as
it is; so is a section never closed, from its first call not closed on.
"""

from __future__ import annotations

import json
import re

from strata_core.serving.tool_call import ToolCall, arguments_json
from strata_core.text.harmony import Piece, held_prefix

__all__ = ["CALLS_BEGIN", "DeepSeekParser", "deepseek_call"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
#: V3 / R1: ``function<｜tool▁sep｜>NAME``, a newline, then the arguments fenced as JSON
_FENCED = re.compile(r"function" + re.escape(SEP) + r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def deepseek_call(body: str) -> ToolCall | None:
    """The call of one ``<｜tool▁call▁begin｜>`` body, None when it is not one (either layout)."""
    fenced = _FENCED.fullmatch(body)
    if fenced is not None:
        name, arguments = fenced.group(1).strip(), fenced.group(2)
    elif SEP in body:
        name, arguments = (part.strip() for part in body.split(SEP, 1))
    else:
        return None
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    arguments = arguments_json(value)
    return ToolCall(name, arguments) if name and arguments is not None else None


class DeepSeekParser:
    """Incremental parser of DeepSeek-V3 replies: ``feed`` text as it streams, ``finish`` at the end."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_section = False

    def feed(self, text: str) -> list[Piece | ToolCall]:
        """The content and the calls that ``text`` completes."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece | ToolCall]:
        """What is held back, at the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece | ToolCall]:
        out: list[Piece | ToolCall] = []
        while self._buf:
            if not self._in_section:
                at = self._buf.find(CALLS_BEGIN)
                if at < 0:  # content, less what may start the section and the white space before it
                    keep = 0 if final else held_prefix(self._buf, CALLS_BEGIN)
                    text = self._buf[:len(self._buf) - keep]
                    text = text if final else text.rstrip()
                    if text:
                        out.append(Piece("content", text))
                    self._buf = self._buf[len(text):]
                    break
                if self._buf[:at].rstrip():
                    out.append(Piece("content", self._buf[:at].rstrip()))
                self._buf, self._in_section = self._buf[at + len(CALLS_BEGIN):], True
                continue
            rest = self._buf.lstrip()
            if rest.startswith(CALLS_END):  # the section is over: what follows is content again
                self._buf, self._in_section = rest[len(CALLS_END):], False
                continue
            if rest.startswith(CALL_BEGIN) and (end := rest.find(CALL_END)) >= 0:
                body = rest[len(CALL_BEGIN):end]
                call = deepseek_call(body)
                out.append(call if call is not None else Piece("content", rest[:end + len(CALL_END)]))
                self._buf = rest[end + len(CALL_END):]
                continue
            if final or not (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest) or rest.startswith(CALL_BEGIN)):
                if rest:  # not a call (or never closed): content as it is
                    out.append(Piece("content", rest))
                self._buf = ""
            break
        return out
