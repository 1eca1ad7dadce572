"""The step runner on the fake engine: a failed window is retried row by row where that is exact,
so a failure ends only the rows it belongs to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from test_server_support import FakeEngine, FakeSession, fake_logits

from strata_core.serving.sampling import Sampler, SamplingParams
from strata_core.serving.step_runner import StepRunner


class _FailsWithSeven(FakeEngine):
    """A window holding a session whose prompt starts with token 7 fails before any step."""

    def decode_window(self, steps, fed=None):  # type: ignore[no-untyped-def]
        if any(s.tokens[:1] == [7] for s, _ in steps):
            raise RuntimeError("device fault")
        return super().decode_window(steps, fed)


@dataclass
class _Row:
    session: FakeSession
    pending: int
    sampler: Sampler = field(default_factory=lambda: Sampler(SamplingParams(temperature=0)))
    history: list[int] = field(default_factory=list)


def _rows(engine: FakeEngine, prompts: list[list[int]]) -> list[_Row]:
    rows = []
    for prompt in prompts:
        session = engine.new_session()
        engine.prefill(session, prompt)
        rows.append(_Row(session, 40, history=list(prompt)))
    return rows


def test_a_failed_window_is_retried_alone_and_fails_only_its_row() -> None:
    engine = _FailsWithSeven()
    rows = _rows(engine, [[5, 6], [7, 8], [9, 10]])
    results = StepRunner(engine).decode(rows)
    assert isinstance(results[1], RuntimeError) and "device fault" in str(results[1])
    for row, result in zip([rows[0], rows[2]], [results[0], results[2]]):
        assert result.token == int(torch.argmax(fake_logits(row.session.tokens)))
    assert engine.windows == [1, 1]  # the two healthy rows, each alone
    assert rows[1].session.n_tokens == 2  # the failed row was never stepped


def test_a_window_that_failed_after_stepping_a_row_is_not_retried_for_it() -> None:
    engine = _FailsWithSeven()
    rows = _rows(engine, [[5, 6], [7, 8]])
    original = engine.decode_window

    def steps_then_fails(steps, fed=None):  # type: ignore[no-untyped-def]
        if len(steps) > 1:
            steps[0][0].tokens.append(steps[0][1])  # the first row's K/V was written before the fault
        return original(steps, fed)

    engine.decode_window = steps_then_fails  # type: ignore[method-assign]
    results = StepRunner(engine).decode(rows)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert "after this request's step" in str(results[0])


def test_overlapped_windows_feed_each_row_its_token_and_take_the_one_before() -> None:
    """Window N+1 is enqueued fed N's sampled tokens, then N's results come back; a row's fed position is
    settled with the token it was fed (FakeSession.settle checks it); a row dropped from the sampling
    is not fed again; a window that cannot be enqueued gives the results of the one before, not queued."""
    engine = FakeEngine()
    rows = _rows(engine, [[5, 6], [9, 10]])
    runner = StepRunner(engine)
    assert runner.decode_overlapped(rows) == ([], True)
    runner.sample_in_flight(lambda row: True)
    assert runner.carries(rows[0]) and runner.in_flight
    results, queued = runner.decode_overlapped(rows)  # fed the first window's tokens on the "device"
    assert queued and [row for row, _ in results] == rows
    for row, (_, result) in zip(rows, results):
        assert result.token == int(torch.argmax(fake_logits(row.session.tokens[:-1])))
        assert row.session.tokens[-1] == result.token and not row.session.unsettled
        row.pending = result.token
    runner.sample_in_flight(lambda row: row is rows[1])  # the first row ended with its token
    assert not runner.carries(rows[0]) and runner.carries(rows[1])
    failing = _FailsWithSeven()
    runner.engine = failing
    bad = _rows(failing, [[7, 1]])
    results, queued = runner.decode_overlapped(bad)
    assert not queued and [row for row, _ in results] == [rows[1]] and not runner.in_flight
