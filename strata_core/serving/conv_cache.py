"""The conversation cache: KV snapshots of displaced conversations, kept in host RAM.

When the scheduler needs a slot whose idle session still holds a finished conversation of an engine
that shares no prefixes (a model with recurrent state: its state is per session, not in the paged
KV blocks that stay cached on the device), it saves that session here (``engine.save_session``)
before freeing it. When a later prompt starts with the
same tokens, the snapshot with the longest common prefix is restored and only the new part of the
prompt is computed. Entries are bounded by count and by bytes; the least recently used go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ConvCache", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    snapshot: Any  # the engine's snapshot object (has .nbytes)
    nbytes: int


class ConvCache:
    """Up to ``max_entries`` snapshots totalling at most ``max_bytes``, found by prefix match."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # key -> entry, oldest first
        self._next_key = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def accepts(self, nbytes: int) -> bool:
        """Whether a snapshot of ``nbytes`` could be kept at all."""
        return self.max_entries > 0 and nbytes <= self.max_bytes

    def put(self, tokens: Sequence[int], snapshot: Any) -> bool:
        """Keep ``snapshot`` of a session holding ``tokens``, evicting older entries; False if it cannot fit.

        An entry whose tokens are a prefix of ``tokens`` (an earlier turn of the same
        conversation) is replaced.
        """
        nbytes = int(snapshot.nbytes)
        if not tokens or not self.accepts(nbytes):
            return False
        key_tokens = tuple(tokens)
        for key in [k for k, e in self._entries.items() if key_tokens[: len(e.tokens)] == e.tokens]:
            self._remove(key)
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            self._remove(next(iter(self._entries)))
        self._entries[self._next_key] = _Entry(key_tokens, snapshot, nbytes)
        self._next_key += 1
        self.nbytes += nbytes
        return True

    def best(self, tokens: Sequence[int], whole: bool = False) -> tuple[int | None, int]:
        """The key of the entry sharing the longest prefix with ``tokens`` and that length; with
        ``whole`` only entries that are a prefix of ``tokens`` in full count (a recurrent state
        cannot be cut back to a shorter prefix)."""
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = common_prefix(entry.tokens, tokens)
            if n > best_len and (not whole or n == len(entry.tokens)):
                best_key, best_len = key, n
        return best_key, best_len

    def take(self, key: int) -> Any:
        """Remove the entry ``key`` and return its snapshot."""
        return self._remove(key).snapshot

    def n_tokens(self, key: int) -> int:
        """Tokens held by entry ``key``."""
        return len(self._entries[key].tokens)

    def peek(self, key: int) -> Any:
        """The snapshot of entry ``key``, which stays (now the most recently used): a prompt that
        shares only part of a conversation must not cost the cache the rest of it."""
        self._entries.move_to_end(key)
        return self._entries[key].snapshot

    def _remove(self, key: int) -> _Entry:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry
