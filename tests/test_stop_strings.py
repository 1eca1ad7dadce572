"""The stop-string matcher: the first stop cuts whatever the pieces, in time linear in the text."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from strata_core.serving.stop_strings import MAX_STOP_CHARS, StopMatcher


def _run(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        released, stopped = matcher.push(piece)
        out += released
        if stopped:
            return out, True
    return out + matcher.held, False


def _first_cut(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the text is cut and by which stop: the one complete first (the longest at a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            word = max(done, key=len)
            return end - len(word), word
    return None


@given(st.text("ab\n", max_size=30), st.lists(st.integers(1, 5), max_size=10),
       st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=4))
def test_cuts_at_the_first_stop_whatever_the_pieces(text: str, cuts: list[int], stops: list[str]) -> None:
    pieces, pos = [], 0
    for n in cuts + [len(text)]:
        pieces.append(text[pos : pos + n])
        pos += n
    matcher = StopMatcher(stops)
    out, stopped = _run(matcher, pieces)
    cut = _first_cut(text, stops)
    assert stopped == (cut is not None)
    assert out == (text if cut is None else text[: cut[0]])
    assert matcher.found == ("" if cut is None else cut[1])


class _CountingStr(str):
    """A stop string that counts how often a character of it is read."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        _CountingStr.reads += 1
        return str.__getitem__(self, key)


def test_work_is_linear_in_the_text_not_the_stop_length() -> None:
    # the worst case of a naive matcher: every position starts a long near-match
    stops = [_CountingStr("a" * (MAX_STOP_CHARS - 1) + tail) for tail in "bcde"]
    matcher = StopMatcher(stops)
    _CountingStr.reads = 0
    n = 20_000
    for _ in range(n // 4):
        released, stopped = matcher.push("aaaa")
        assert not stopped
    assert len(matcher.held) == MAX_STOP_CHARS - 1  # only a possible stop start is held back
    assert _CountingStr.reads <= 3 * n * len(stops)  # amortised O(1) reads per character and stop
