"""A planned step on the engine: the decode window and the prompt chunks, and their sampled tokens.

Every call comes from the scheduler's worker thread (the engine is not thread-safe). A failure is
given back per request, never raised for a window or a prompt batch: one that fails is run again
row by row (chunk by chunk) where that is exact (K/V is rewritten in place; a recurrent state some
layers already advanced is not), and a sampling call that fails samples row by row, so a failure
ends only the requests it belongs to. After every engine call the engine's counters are read once
(``telemetry``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from strata_core.serving.sampling import Sampler, SampleResult, sample_rows

__all__ = ["Row", "StepRunner"]

log = logging.getLogger(__name__)


class Row(Protocol):
    """A request as the runner sees it."""

    session: Any
    pending: int  # the token a window feeds
    sampler: Sampler
    history: list[int]  # the tokens the sampler's penalties see


class StepRunner:
    """Runs decode windows and prompt chunks on ``engine`` and samples their tokens."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.telemetry: dict[str, Any] = {}
        self.experts_by_device: dict[str, dict[str, int]] = {}
        self.read_telemetry()

    def read_telemetry(self) -> dict[str, Any]:
        """Read the engine's counters and keep them, with the expert groups each device slot served
        by source (``experts_by_device``, for ``/metrics``)."""
        self.telemetry = dict(self.engine.telemetry.snapshot())
        self.experts_by_device = self.engine.telemetry.by_device()
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
