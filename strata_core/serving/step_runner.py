"""A planned step on the engine: the decode window and the prompt chunks, and their sampled tokens.

Every call comes from the scheduler's worker thread (the engine is not thread-safe). A failure is
given back per request, never raised for a window or a prompt batch: one that fails is run again
row by row (chunk by chunk) where that is exact (K/V is rewritten in place; a recurrent state some
layers already advanced is not), and a sampling call that fails samples row by row, so a failure
ends only the requests it belongs to. After every engine call the engine's counters are read once
(``telemetry``).

Overlapped windows (``decode_overlapped``): window N+1 is enqueued before the host waits for window
N's tokens, each row that was in window N fed N's sampled token on the device; then N's tokens come
back and are taken (text, stops) while N+1 runs, and N+1's sampling is enqueued for the rows still
generating (``sample_in_flight``). A row that ended with N's token was in N+1 too: its session keeps
that last token (a consistent state, one position longer), its N+1 token is never sampled. The
counters are not read after each overlapped window (a read waits for the device): the scheduler
reads them when a request ends, when nothing is in flight, before a prompt batch and every
``TELEMETRY_WINDOWS`` windows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from strata_core.runtime.devices import to_device
from strata_core.serving.sampling import PendingSamples, Sampler, SampleResult, sample_rows, start_sampling

__all__ = ["Row", "StepRunner", "TELEMETRY_WINDOWS"]

#: overlapped windows between two reads of the engine's counters
TELEMETRY_WINDOWS = 64

log = logging.getLogger(__name__)


class Row(Protocol):
    """A request as the runner sees it."""

    session: Any
    pending: int  # the token a window feeds
    sampler: Sampler
    history: list[int]  # the tokens the sampler's penalties see


@dataclass
class _Flight:
    """An overlapped window: its rows, the position each row's fed token took, its logits, and its
    sampling once enqueued (for the rows in ``sampled``)."""

    rows: list[Row]
    positions: list[int]
    logits: torch.Tensor
    samples: PendingSamples | None = None
    sampled: list[Row] = field(default_factory=list)


class StepRunner:
    """Runs decode windows and prompt chunks on ``engine`` and samples their tokens."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.telemetry: dict[str, Any] = {}
        self.experts_by_device: dict[str, dict[str, int]] = {}
        self._flight: _Flight | None = None
        self._unread = 0  # overlapped windows since the counters were last read
        self.read_telemetry()

    def read_telemetry(self) -> dict[str, Any]:
        """Read the engine's counters and keep them, with the expert groups each device slot served
        by source (``experts_by_device``, for ``/metrics``)."""
        self.telemetry = dict(self.engine.telemetry.snapshot())
        self.experts_by_device = self.engine.telemetry.by_device()
        self._unread = 0
        return self.telemetry

    def prefill(self, chunks: Sequence[tuple[Row, Sequence[int], bool]]) -> list[SampleResult | None | Exception]:
        """Extend each row's session by its tokens, the chunks in one engine call; for a chunk with
        ``sample`` set (its prompt's last), the row's first token, sampled from the last position's
        logits. A failed call is run again chunk by chunk (only a rewindable model's chunks are
        batched: their K/V is rewritten in place), so a failure ends only the requests it belongs to."""
        failed: dict[int, Exception] = {}
        try:
            try:
                logits = self.engine.prefill_batch([(row.session, tokens) for row, tokens, _ in chunks])
            except Exception as exc:  # noqa: BLE001 - run each chunk alone to find the failing request
                if len(chunks) == 1:
                    return [exc]
                log.exception("a prompt batch of %d chunks failed; retrying each chunk alone", len(chunks))
                alone = []
                for i, (row, tokens, _) in enumerate(chunks):
                    try:
                        alone.append(self.engine.prefill_batch([(row.session, tokens)])[0])
                    except Exception as error:  # noqa: BLE001
                        failed[i] = error
                logits = torch.stack(alone) if alone else None
            live = [i for i in range(len(chunks)) if i not in failed]  # the chunks of the rows of logits
            sampling = [(row, i) for row, i in enumerate(live) if chunks[i][2]]
            sampled: dict[int, SampleResult | Exception] = {}
            if sampling:
                picked = logits[[row for row, _ in sampling]]
                for (_, i), result in zip(sampling, self._sample(picked, [chunks[i][0] for _, i in sampling])):
                    sampled[i] = result
        finally:
            self.read_telemetry()
        return [failed.get(i, sampled.get(i)) for i in range(len(chunks))]

    def decode(self, rows: Sequence[Row]) -> list[SampleResult | Exception]:
        """One window over ``rows``: each row's next token, or the error that ends its request."""
        before = [row.session.n_tokens for row in rows]
        failed: dict[int, Exception] = {}
        try:
            try:
                logits = self.engine.decode_window([(row.session, row.pending) for row in rows])
            except Exception:  # noqa: BLE001 - run each row alone to find the failing request
                log.exception("decode window of %d failed; retrying each request alone", len(rows))
                alone = []
                for i, (row, n) in enumerate(zip(rows, before)):
                    try:
                        alone.append(self._alone(row, n))
                    except Exception as exc:  # noqa: BLE001
                        failed[i] = exc
                logits = torch.stack(alone) if alone else None
            live = [row for i, row in enumerate(rows) if i not in failed]
            sampled = iter(self._sample(logits, live) if live else [])
        finally:  # after sampling: the device counters are read once the window's tokens came back
            self.read_telemetry()
        return [failed[i] if i in failed else next(sampled) for i in range(len(rows))]

    @property
    def unread(self) -> int:
        """Overlapped windows enqueued since the counters were last read."""
        return self._unread

    def carries(self, row: Row) -> bool:
        """Whether ``row``'s next token is being sampled in the window in flight."""
        return self._flight is not None and any(r is row for r in self._flight.sampled)

    @property
    def in_flight(self) -> bool:
        """Whether an overlapped window's tokens are still to be taken."""
        return self._flight is not None

    def decode_overlapped(self, rows: Sequence[Row]) -> tuple[list[tuple[Row, SampleResult | Exception]], bool]:
        """Enqueue a window over ``rows`` (a row of the window in flight fed its sampled token there,
        the others their ``pending``; none: nothing enqueued), then wait for the window in flight: its
        rows' results, and whether the new window is in flight now (False: none, or it could not be
        enqueued, and ``decode`` runs it after the scheduler took the results)."""
        prev, queued = self._flight, False
        self._flight = None
        if rows:
            try:
                fed, taken = self._fed_tokens(rows, prev)
                positions = [row.session.n_tokens for row in rows]
                logits = self.engine.decode_window([(row.session, row.pending) for row in rows], fed)
                if fed is not None:  # the rows fed from the host know their token now
                    for row, position, device_fed in zip(rows, positions, taken):
                        if not device_fed:
                            row.session.settle(position, row.pending)
                self._flight, queued = _Flight(list(rows), positions, logits), True
                self._unread += 1
            except Exception:  # noqa: BLE001 - run again by ``decode``, which finds the failing rows
                log.exception("an overlapped decode window of %d failed to enqueue; running it again", len(rows))
        return self._take(prev), queued

    def sample_in_flight(self, keep: Callable[[Row], bool]) -> None:
        """Enqueue the sampling of the window in flight for its rows that ``keep`` (still generating)."""
        flight = self._flight
        if flight is None:
            return
        kept = [i for i, row in enumerate(flight.rows) if keep(row)]
        flight.sampled = [flight.rows[i] for i in kept]
        if not kept:
            self._flight = None
            return
        logits = (flight.logits if len(kept) == len(flight.rows) else
                  flight.logits.index_select(0, to_device(torch.tensor(kept), flight.logits.device)))
        flight.samples = start_sampling(logits, [(row.sampler, row.history) for row in flight.sampled])

    def _fed_tokens(self, rows: Sequence[Row], prev: _Flight | None) -> tuple[torch.Tensor | None, list[bool]]:
        """The window's tokens on the device, int64 ``[len(rows)]``: a row sampled in ``prev`` its token
        there, the others their ``pending`` (None when no row is fed from ``prev``: the steps' own
        tokens), and which rows were fed from ``prev``."""
        at = {id(row): i for i, row in enumerate(prev.sampled)} if prev is not None and prev.samples else {}
        taken = [id(row) in at for row in rows]
        if not any(taken):
            return None, taken
        tokens = prev.samples.tokens
        host = to_device(torch.tensor([row.pending for row in rows]), tokens.device)
        index = to_device(torch.tensor([at.get(id(row), -1) for row in rows]), tokens.device)
        return torch.where(index >= 0, tokens[index.clamp(min=0)], host), taken

    def _take(self, flight: _Flight | None) -> list[tuple[Row, SampleResult | Exception]]:
        """The sampled rows of ``flight`` with their results (waiting for them); a row of the window
        after it (the one in flight now) that it fed gets its position settled with the token."""
        if flight is None or flight.samples is None:
            return []
        try:
            results = flight.samples.results()
        except Exception as exc:  # noqa: BLE001 - a failed copy fails the window's rows, not the server
            results = [exc] * len(flight.sampled)
        now = self._flight
        fed = {id(row): p for row, p in zip(now.rows, now.positions)} if now is not None else {}
        for row, result in zip(flight.sampled, results):
            if id(row) in fed and not isinstance(result, Exception):
                row.session.settle(fed[id(row)], result.token)
        return list(zip(flight.sampled, results))

    def _alone(self, row: Row, n_before: int) -> torch.Tensor:
        if row.session.n_tokens != n_before:
            raise RuntimeError("the decode window failed after this request's step")
        if not self.engine.spec.rewindable:  # a retry would advance the state a second time
            raise RuntimeError("the decode window failed after some layers updated this request's recurrent state")
        return self.engine.decode_window([(row.session, row.pending)])[0]

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> list[SampleResult | Exception]:
        """Every row's next token from ``logits`` ``[B, V]`` in one call on their device; if the call
        itself fails, row by row."""
        try:
            return list(sample_rows(logits, [(row.sampler, row.history) for row in rows]))
        except Exception:  # noqa: BLE001
            log.exception("sampling a window of %d failed; sampling each row alone", len(rows))
            out: list[SampleResult | Exception] = []
            for row, row_logits in zip(rows, logits):
                try:
                    out.append(row.sampler.sample_result(row_logits, row.history))
                except Exception as exc:  # noqa: BLE001
                    out.append(exc)
            return out
