"""Sessions: one conversation's KV state and the tokens it holds; decode batches of sessions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from strata_core.model.kvcache import KVCache, KVSnapshot

_ids = itertools.count(1)

#: which logits a prompt chunk returns: every position, the last one, or none (not the last chunk)
LogitsWanted = Literal["all", "last", "none"]


@dataclass
class Session:
    """The state of one sequence: the tokens whose KV is held, and the KV cache itself.

    Compute reads and writes ``kv``; ``tokens`` is the record used for prefix reuse.
    """

    kv: KVCache
    tokens: list[int] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def n_tokens(self) -> int:
        """Positions held in the KV cache."""
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens' state (for reusing a shared prefix)."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot truncate a session of {self.n_tokens} tokens to {n}")
        self.kv.truncate(n)
        del self.tokens[n:]


@dataclass(frozen=True)
class DecodeBatch:
    """One decode window: every session appends exactly one token."""

    sessions: tuple[Session, ...]
    tokens: torch.Tensor  # [B] int64

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def positions(self) -> torch.Tensor:
        """The position each session's new token takes, ``[B]`` int64."""
        return torch.tensor([s.n_tokens for s in self.sessions], dtype=torch.int64)


@dataclass(frozen=True)
class SessionSnapshot:
    """A host-RAM copy of a session (for the conversation cache)."""

    tokens: tuple[int, ...]
    kv: KVSnapshot

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return self.kv.nbytes
