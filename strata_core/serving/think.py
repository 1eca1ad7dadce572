"""``<think>`` reasoning in replies (Qwen3, DeepSeek-R1, QwQ): the text of a leading ``<think>`` block is
reasoning, the rest is the reply (as llama-server's default ``--reasoning-format``).

A reply starts inside the block when the prompt opened it (the generation prompt ends with an unclosed
``<think>``: ``opens_reasoning``); else a reply that starts with ``<think>`` (after white space) opens
it. The block ends at ``</think>``; the white space after it is dropped, and what follows goes to the
reply's own parser (tool calls) or is content. A block never closed is reasoning to the end.
"""

from __future__ import annotations

from typing import Any, Protocol

from strata_core.text.harmony import Piece, held_prefix

__all__ = ["OPEN_THINK", "ThinkParser", "opens_reasoning", "thinks"]

OPEN_THINK, CLOSE_THINK = "<think>", "</think>"


def thinks(template_source: str) -> bool:
    """Whether replies under a chat template may reason in ``<think>`` blocks."""
    return OPEN_THINK in template_source


def opens_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a ``<think>`` block (the reply starts with reasoning)."""
    at = prompt.rfind(OPEN_THINK)
    return at >= 0 and CLOSE_THINK not in prompt[at:]


class _Inner(Protocol):
    def feed(self, text: str) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


class ThinkParser:
    """Reasoning of the leading ``<think>`` block, the rest through ``inner`` (None: content)."""

    def __init__(self, inner: _Inner | None, opened: bool) -> None:
        self._inner = inner
        self._state = "reasoning" if opened else "start"  # start -> reasoning -> after -> reply
        self._buf = ""

    def feed(self, text: str) -> list[Any]:
        """What ``text`` completes."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Any]:
        """What is held back, at the end of the reply."""
        out = self._drain(final=True)
        return out + (self._inner.finish() if self._inner is not None else [])

    def _reply(self, text: str) -> list[Any]:
        if self._inner is not None:
            return self._inner.feed(text)
        return [Piece("content", text)] if text else []

    def _drain(self, final: bool) -> list[Any]:
        out: list[Any] = []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN_THINK):
                    self._buf, self._state = head[len(OPEN_THINK):], "reasoning"
                elif final or not OPEN_THINK.startswith(head):
                    self._state = "reply"
                else:
                    return out  # white space, or what may open the block
            elif self._state == "reasoning":
                at = self._buf.find(CLOSE_THINK)
                if at < 0:
                    keep = 0 if final else held_prefix(self._buf, CLOSE_THINK)
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    if text:
                        out.append(Piece("reasoning", text))
                    return out
                if at:
                    out.append(Piece("reasoning", self._buf[:at]))
                self._buf, self._state = self._buf[at + len(CLOSE_THINK):], "after"
            elif self._state == "after":
                self._buf = self._buf.lstrip()
                if not self._buf and not final:
                    return out
                self._state = "reply"
            else:
                text, self._buf = self._buf, ""
                return out + (self._reply(text) if text else [])
