"""Sessions: one conversation's KV state and the tokens it holds; prompt and decode batches of sessions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from strata_core.model.kvcache import KVCache
    from strata_core.model.kvtransfer import KVSnapshot

_ids = itertools.count(1)

#: which logits a prompt chunk returns: every position, the last one, or none (not the last chunk)
LogitsWanted = Literal["all", "last", "none"]
#: ``Session.tokens`` at a position whose token a decode window read on the device, until ``settle``
UNSET = -1


@dataclass
class Session:
    """The state of one sequence: the tokens whose KV is held, and the KV cache itself.

    Compute reads and writes ``kv``; ``tokens`` is the record used for prefix reuse (``UNSET`` at a
    position a window fed from the device, until the token is known on the host: ``settle``).
    """

    kv: KVCache
    tokens: list[int] = field(default_factory=list)
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def n_tokens(self) -> int:
        """Positions held in the KV cache."""
        return len(self.tokens)

    def settle(self, position: int, token: int) -> None:
        """Record ``token`` at ``position``, which a decode window fed from the device (``UNSET`` there)."""
        if self.tokens[position] != UNSET:
            raise ValueError(f"position {position} holds token {self.tokens[position]}, not one to settle")
        self.tokens[position] = token

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens' state (for reusing a shared prefix)."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot truncate a session of {self.n_tokens} tokens to {n}")
        self.kv.truncate(n)
        del self.tokens[n:]


@dataclass(frozen=True)
class PromptBatch:
    """Prompt chunks of one or more sessions computed in one pass: their ids end to end in
    ``tokens``, session by session (each session once). The layers run every row together; only
    attention and the KV writes are per session."""

    sessions: tuple[Session, ...]
    tokens: torch.Tensor  # [T] int64
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, chunks: Sequence[tuple[Session, torch.Tensor]]) -> PromptBatch:
        """The batch of ``chunks``: (session, its int64 token ids ``[n]``, n >= 1) each."""
        sessions = tuple(session for session, _ in chunks)
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("a session appears twice in one prompt batch")
        if not chunks or any(len(tokens) == 0 for _, tokens in chunks):
            raise ValueError("a prompt batch needs at least one token for every session")
        return cls(sessions, torch.cat([tokens for _, tokens in chunks]), tuple(len(t) for _, t in chunks))

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def spans(self) -> list[tuple[Session, int, int]]:
        """``(session, start, end)``: the rows of ``tokens`` that are each session's chunk."""
        out, start = [], 0
        for session, n in zip(self.sessions, self.lengths):
            out.append((session, start, start + n))
            start += n
        return out

    @property
    def positions(self) -> torch.Tensor:
        """The position of every row, ``[T]`` int64 (each chunk continues its session)."""
        return torch.cat([torch.arange(s.n_tokens, s.n_tokens + n) for s, n in zip(self.sessions, self.lengths)])

    @property
    def last_rows(self) -> torch.Tensor:
        """The row of each chunk's last token, ``[len(sessions)]`` int64."""
        return torch.tensor(self.lengths, dtype=torch.int64).cumsum(0) - 1


@dataclass(frozen=True)
class DecodeBatch:
    """One decode window: each row appends one token to its session (``fed``: the tokens are on the
    device, the sampled ones of the window before; the sessions record ``UNSET`` until they are
    settled). A session may have several rows, in a run with ``offsets`` 0, 1, ... (a speculative
    window verifying drafted tokens): row r's token takes position ``n_tokens + offsets[r]``, and
    attends to its session's rows before it in the window (their K/V is written first)."""

    sessions: tuple[Session, ...]
    tokens: torch.Tensor  # [B] int64
    fed: bool = False
    offsets: tuple[int, ...] = ()  # empty: one row a session

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def positions(self) -> torch.Tensor:
        """The position each row's new token takes, ``[B]`` int64."""
        offsets = self.offsets or (0,) * len(self.sessions)
        return torch.tensor([s.n_tokens + o for s, o in zip(self.sessions, offsets)], dtype=torch.int64)

    def runs(self, first: Sequence[int]) -> list[tuple[Session, int, int, int]]:
        """The rows as runs of one session each: ``(session, position of its first row, start, end)``
        (``first``: each row's position)."""
        runs: list[tuple[Session, int, int, int]] = []
        for row, session in enumerate(self.sessions):
            if runs and runs[-1][0] is session:
                runs[-1] = (*runs[-1][:3], row + 1)
            else:
                runs.append((session, first[row], row, row + 1))
        return runs

    def spans(self, contexts: Sequence[int], by_row: bool = False) -> list[tuple[KVCache, int, int, int]]:
        """The rows as ``attention_spans``' spans: each session's run of rows (its one row, or a speculative
        window's rows) over its positions up to the run's last, or with ``by_row`` each row alone
        (``contexts``: each row's position + 1)."""
        if by_row:
            return [(session.kv, b, b + 1, contexts[b]) for b, session in enumerate(self.sessions)]
        return [(session.kv, a, b, contexts[b - 1]) for session, _, a, b in self.runs(contexts)]

    @property
    def keeps_steps(self) -> bool:
        """Whether a session keeps its recurrent state after each of its rows (``KVCache.keep_steps``): host
        bookkeeping of the states kept, so the window runs eagerly."""
        return bool(self.offsets) and any(session.kv.keeps_steps for session in self.sessions)


@dataclass(frozen=True)
class SessionSnapshot:
    """A host-RAM copy of a session (for the conversation cache)."""

    tokens: tuple[int, ...]
    kv: KVSnapshot

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return self.kv.nbytes
