"""Stop strings: cut streamed text at the first stop string, in time linear in the text.

OpenAI allows at most ``MAX_STOPS`` stop strings; Strata also caps their length at
``MAX_STOP_CHARS`` characters. Each stop string keeps a Knuth-Morris-Pratt state (the longest
prefix of it that ends the text so far), so a pushed character costs O(number of stops), amortised,
whatever the stop strings' length, and text is never searched twice.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "StopMatcher"]

MAX_STOPS = 4
MAX_STOP_CHARS = 1024


def _failure(pattern: str) -> list[int]:
    """KMP failure table: ``out[i]`` is the longest proper border of ``pattern[: i + 1]``."""
    out = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = out[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        out[i] = k
    return out


class StopMatcher:
    """Give out streamed text up to the first stop string, holding back what may start one.

    A stop string is found when its last character arrives; of two found at the same character the
    longer (earlier-starting) one cuts. ``held`` is the text held back so far; ``found`` the stop
    string that cut (``""`` until one does).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._tables = [_failure(s) for s in self._stops]
        self._states = [0] * len(self._stops)
        self.held = ""
        self.found = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Text safe to give out, and whether a stop string was found (the text ends before it)."""
        buf = self.held + text
        for end, ch in enumerate(text, len(self.held) + 1):
            found = ""
            for j, (stop, table) in enumerate(zip(self._stops, self._tables)):
                k = self._states[j]
                while k and stop[k] != ch:
                    k = table[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    found = max(found, stop, key=len)
                    k = table[k - 1]
                self._states[j] = k
            if found:
                self.held, self.found = "", found
                return buf[: end - len(found)], True
        keep = max(self._states, default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False
