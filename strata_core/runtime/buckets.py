"""Batch buckets: a graphed decode window padded to its bucket (``graphs.bucket``) with rows that are
computed and not counted.

The padding rows belong to one padding session (token 0 at position 0, one KV block, every layer at
home in the decode placement). While a padded window runs, the expert rows count only its first
``live`` (token, expert) pairs: the gather's bookkeeping reads that count from a device tensor, a
graph's static input, so one graph serves every window of its bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from strata_core.experts.device_rows import CachedExpertRows
from strata_core.runtime.graphs import BUCKETS, bucket
from strata_core.runtime.session import DecodeBatch, Session

__all__ = ["BatchPadding"]


class BatchPadding:
    """Pads decode windows to their bucket. ``new_session`` makes the padding session (once, at first
    need); ``experts_used``: the (token, expert) pairs of a row."""

    def __init__(self, new_session: Callable[[], Session], experts_used: int) -> None:
        self._new_session = new_session
        self._session: Session | None = None
        self.experts_used = experts_used

    @property
    def session(self) -> Session:
        """The session whose rows pad a window."""
        if self._session is None:
            self._session = self._new_session()
        return self._session

    def pad(self, batch: DecodeBatch) -> tuple[DecodeBatch, int]:
        """``batch`` padded to its bucket with the padding session's rows, and how many rows are real."""
        live = sum(1 for s in batch.sessions if s is not self._session)
        extra = bucket(len(batch)) - len(batch)
        if extra == 0:
            return batch, live
        offsets = batch.offsets + (0,) * extra if batch.offsets else ()
        return DecodeBatch(batch.sessions + (self.session,) * extra,
                           torch.cat([batch.tokens, batch.tokens.new_zeros(extra)]), batch.fed, offsets), live

    def live_pairs(self, rows: int) -> torch.Tensor:
        """int64 ``[1]``: the (token, expert) pairs of ``rows`` real rows (a graph's static input)."""
        return torch.tensor([rows * self.experts_used], dtype=torch.int64)

    @staticmethod
    @contextmanager
    def counting(rows: CachedExpertRows, live: torch.Tensor) -> Iterator[None]:
        """While the block runs, ``rows`` count only the first ``live`` pairs of a window."""
        rows.live_pairs = live
        try:
            yield
        finally:
            rows.live_pairs = None

    def windows(self, sessions: int) -> list[DecodeBatch]:
        """One window of padding rows for every bucket a window of up to ``sessions`` sessions takes."""
        sizes = [b for b in BUCKETS if b < sessions] + [bucket(sessions)]
        return [DecodeBatch((self.session,) * size, torch.zeros(size, dtype=torch.int64)) for size in sizes]
