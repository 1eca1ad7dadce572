"""Split gpt-oss's harmony output into reasoning and content, as llama.cpp's server does.

A harmony reply is a sequence of messages: a header (``<|start|>assistant`` — for the first message
the end of the generation prompt, so not in the output —, ``<|channel|>NAME``, for a tool call a
recipient `` to=functions.f`` and maybe ``<|constrain|>json``), ``<|message|>``, the body, and
``<|end|>``; the last (final) message ends the generation with ``<|return|>``, an end-of-generation
token that never reaches the text. llama.cpp (``common/parsers/gpt-oss.cpp``) gives analysis bodies
as ``reasoning_content``, final bodies and commentary preambles as ``content``, and a message to
``functions.NAME`` as a tool call (its body, the arguments, is given whole as a "tool" piece once it
ends; with ``tools`` off, and for other recipients, it is consumed without output). A tool call's
message ends with ``<|call|>``, an end-of-generation token, so its body ends with the text. The
output text must keep the markers (the scheduler's ``keep_special_tokens``).

Text where a header should start but none does (a model that does not follow the format) is content
up to the next ``<|end|>``; a header that does not reach ``<|message|>`` within ``MAX_HEADER``
characters is content too; an unfinished header at the end of generation gives nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_HEADER", "HarmonyParser", "Piece", "held_prefix", "parse", "uses_harmony"]

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RECIPIENT = "to="  # a first message's header may open with its recipient (" to=functions.f<|channel|>...")
FUNCTIONS = "functions."  # the namespace of the request's tools in a recipient
HEADER_OPENINGS = (START, CHANNEL, RECIPIENT)
MAX_HEADER = 256


@dataclass(frozen=True)
class Piece:
    """Text of one kind, in output order: ``kind`` is "reasoning", "content" or "tool" (the arguments
    of a call to the function ``name``)."""

    kind: str
    text: str
    name: str = ""


def uses_harmony(template_source: str) -> bool:
    """Whether a chat template renders harmony (llama.cpp's test: its source has ``<|channel|>``)."""
    return CHANNEL in template_source


def _word_after(header: str, marker: str) -> str | None:
    """The word after the last ``marker`` in ``header`` (up to a space or the next ``<|``), None if absent."""
    at = header.rfind(marker)
    if at < 0:
        return None
    word = header[at + len(marker):].split("<|", 1)[0]
    return word.split(None, 1)[0] if word.strip() else ""


def _sink(header: str, tools: bool) -> tuple[str, str]:
    """Where a message's body goes: "reasoning", "content", "tool" (with the function's name) or
    "drop" (a message to another recipient, or to a function with ``tools`` off)."""
    recipient = _word_after(" " + header, " " + RECIPIENT)
    if recipient is not None and recipient != "assistant":  # gpt-oss-20b's stray " to=assistant" is no call
        name = recipient.removeprefix(FUNCTIONS)
        return ("tool", name) if tools and name and recipient.startswith(FUNCTIONS) else ("drop", "")
    return ("reasoning" if _word_after(header, CHANNEL) == "analysis" else "content"), ""


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (may become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HarmonyParser:
    """Incremental parser: ``feed`` text as it streams, ``finish`` at the end of generation. Any split
    of the text gives the same pieces, joined by kind, as feeding it whole. With ``tools``, calls to
    functions are "tool" pieces."""

    def __init__(self, tools: bool = False) -> None:
        self._tools = tools
        self._buf = ""
        self._sink: str | None = None  # None: a header is expected; else the current body's sink
        self._name = ""  # the function the current body calls (sink "tool")

    def feed(self, text: str) -> list[Piece]:
        """The reasoning and content that ``text`` completes (text that may be a marker is held)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        """What is held back, at the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while self._buf:
            if self._sink is None:
                if not self._header(final):
                    break
                continue
            sink, at = self._sink, self._buf.find(END)
            if at < 0 and sink == "tool" and not final:
                break  # a call is given whole
            if at >= 0:
                body, self._buf, self._sink = self._buf[:at], self._buf[at + len(END):], None
            else:
                cut = len(self._buf) - (0 if final else held_prefix(self._buf, END))
                body, self._buf = self._buf[:cut], self._buf[cut:]
            if sink == "tool":
                out.append(Piece(sink, body, self._name))
            elif body and sink != "drop":
                if out and out[-1].kind == sink:
                    out[-1] = Piece(sink, out[-1].text + body)
                else:
                    out.append(Piece(sink, body))
            if at < 0:
                break
        if final:
            self._buf, self._sink = "", None  # an unfinished header gives nothing
        return out

    def _header(self, final: bool) -> bool:
        """Read a header at the start of the buffer; False when more text is needed."""
        lead = self._buf.lstrip()
        if not lead.startswith(HEADER_OPENINGS):
            if not lead or (not final and any(opening.startswith(lead) for opening in HEADER_OPENINGS)):
                return False  # may still become a header (at the end: only white space, dropped)
            self._sink = "content"  # not a header: a body without one
            return True
        window = self._buf[:MAX_HEADER + len(MESSAGE)]
        at = window.find(MESSAGE)
        if at < 0:
            if len(window) < MAX_HEADER + len(MESSAGE):
                return False  # more to come (at the end: an unfinished header, dropped)
            self._sink = "content"  # too long for a header: the model left the format
            return True
        self._sink, self._name = _sink(self._buf[:at], self._tools)
        self._buf = self._buf[at + len(MESSAGE):]
        return True


def parse(text: str) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole harmony output."""
    parser = HarmonyParser()
    pieces = parser.feed(text) + parser.finish()
    return ("".join(p.text for p in pieces if p.kind == "reasoning"),
            "".join(p.text for p in pieces if p.kind == "content"))
