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

    def steps_then_fails(steps):  # type: ignore[no-untyped-def]
        if len(steps) > 1:
            steps[0][0].tokens.append(steps[0][1])  # the first row's K/V was written before the fault
        return original(steps)

    engine.decode_window = steps_then_fails  # type: ignore[method-assign]
    results = StepRunner(engine).decode(rows)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert "after this request's step" in str(results[0])
