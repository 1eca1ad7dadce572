"""The conversation cache: prefix lookup, replacement of earlier turns, count and byte bounds."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from strata_core.serving.conv_cache import ConvCache, common_prefix


@dataclass(frozen=True)
class Snap:
    name: str
    nbytes: int = 10


def test_best_finds_the_longest_shared_prefix_and_take_removes_it() -> None:
    cache = ConvCache(4, 1000)
    cache.put([1, 2, 3], Snap("a"))
    cache.put([1, 2, 9, 9], Snap("b"))
    cache.put([7], Snap("c"))
    key, n = cache.best([1, 2, 9, 5])
    assert n == 3 and cache.take(key) == Snap("b")
    assert cache.best([1, 2, 9, 5])[1] == 2 and len(cache) == 2 and cache.nbytes == 20
    assert cache.best([4, 4]) == (None, 0)


def test_a_later_turn_replaces_the_earlier_one() -> None:
    cache = ConvCache(4, 1000)
    cache.put([1, 2], Snap("turn1"))
    cache.put([1, 2, 3, 4], Snap("turn2"))
    assert len(cache) == 1 and cache.take(cache.best([1, 2, 3, 4, 5])[0]) == Snap("turn2")


def test_bounds_evict_the_least_recently_added() -> None:
    cache = ConvCache(2, 25)
    for i in range(3):
        assert cache.put([i], Snap(str(i)))
    assert len(cache) == 2 and cache.best([0])[1] == 0  # count bound
    assert cache.put([5], Snap("big", nbytes=20))
    assert len(cache) == 1 and cache.nbytes == 20  # byte bound
    assert not cache.put([6], Snap("huge", nbytes=26)) and len(cache) == 1
    assert not ConvCache(0, 100).put([1], Snap("off"))


@given(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=8))
def test_common_prefix(a: list[int], b: list[int]) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])
