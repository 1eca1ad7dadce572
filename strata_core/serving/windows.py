"""The decode window of a scheduler step, run one of three ways: one at a time (the runner samples the
window's tokens before the next is enqueued), overlapped (``StepRunner.decode_overlapped``: the next
window is enqueued before this one's tokens reach the host) or speculative (strata_core.serving.speculation:
a request's drafted tokens verified as extra rows of its session). Each request takes its
tokens through the scheduler's ``accept`` (text, stops) or fails alone through its ``fail``."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata_core.serving.requests import SchedulerStats
from strata_core.serving.sampling import Sampler, SampleResult
from strata_core.serving.slots import Slot, Slots
from strata_core.errors import ConfigError
from strata_core.serving.mtp_drafts import MtpDrafter
from strata_core.serving.speculation import Drafter, NgramDrafter, accepted
from strata_core.serving.step_runner import TELEMETRY_WINDOWS, StepRunner

__all__ = ["DecodeWindows"]

log = logging.getLogger(__name__)


@dataclass
class _DraftRow:
    """A drafted token's row of a speculative window, as the step runner sees a row: its request's
    session, the token it feeds, the tokens before its draw (the request's and the drafts up to this
    one: what penalties see there) and a sampler of its own, at the step the request's draw there
    would take (its seed's uniform for that token)."""

    job: Any  # the scheduler's request
    pending: int
    history: list[int]
    sampler: Sampler

    @property
    def session(self) -> Any:
        return self.job.session


def _draft_rows(job: Any, drafts: list[int]) -> list[_DraftRow]:
    """The rows of ``job``'s drafts: draft i's row draws at the request's step + i + 1."""
    rows = []
    for i, token in enumerate(drafts):
        sampler = copy.copy(job.sampler)  # its params and seed, a step of its own
        sampler.step = job.sampler.step + i + 1
        rows.append(_DraftRow(job, token, job.history + drafts[:i + 1], sampler))
    return rows


class DecodeWindows:
    """Runs the decode windows of a scheduler's steps on ``runner``: ``overlap`` (for a model whose state
    can be rewound, without speculation), ``spec_tokens`` drafted tokens a window (0: none; a recurrent
    state is kept after each row of a request's window, so its rejected rows are cut back too) by
    ``drafts`` ("ngram": prompt lookup; "mtp": the engine's MTP block, ``Engine.load_mtp``).
    ``accept(slot, result, held)`` gives a request its token (``held``: the positions its session holds
    before it, when not ``n_tokens``), ``fail(slot, exc)`` ends it."""

    def __init__(self, runner: StepRunner, slots: Slots, stats: SchedulerStats, max_context: int, rewindable: bool,
                 overlap: bool, spec_tokens: int, accept: Callable[[Slot, SampleResult, int | None], None],
                 fail: Callable[[Slot, Exception], None], drafts: str = "ngram") -> None:
        self._runner, self._slots, self.stats, self.max_context = runner, slots, stats, max_context
        self._accept, self._fail = accept, fail
        self.spec_tokens = spec_tokens
        self._mtp = getattr(runner.engine, "mtp", None) if drafts == "mtp" else None
        if drafts == "mtp" and spec_tokens and self._mtp is None:
            raise ConfigError("MTP drafts need the engine's MTP block (load the engine with --spec mtp)")
        # not over recurrent state, which a window that fails part way has advanced: its requests must fail,
        # not take the tokens of the window before
        self.overlap = overlap and rewindable and not self.spec_tokens
        log.info("decode windows: %s", f"speculative, up to {self.spec_tokens} {drafts} drafts a request"
                 if self.spec_tokens else "overlapped" if self.overlap else "one at a time")
        self._uncounted: dict[int, Any] = {}  # the requests of overlapped windows since the counters' last read
        self._counted: dict[str, Any] = {}  # the counters at that read

    def before_prompts(self) -> None:
        """Before a prompt batch: the overlapped windows' counts read first, apart from the batch's."""
        if self._runner.unread:
            self._read_counters()

    def after_prompts(self) -> None:
        """After a prompt batch: its counts are not the windows'."""
        self._counted = self._runner.telemetry

    def run(self, slots: list[Slot]) -> None:
        """One decode window for ``slots``; each request takes its token or fails alone. Overlapped, the
        tokens taken are those of the window before, this one's sampling enqueued after them."""
        if self.overlap:
            self._overlapped(slots)
        elif slots and self.spec_tokens:
            self._speculative(slots)
        elif slots:
            start, before = time.perf_counter(), self._runner.telemetry
            self._take(slots, self._runner.decode([s.job for s in slots]), before)
            self.stats.windows += 1
            self.stats.decode_seconds += time.perf_counter() - start

    def _overlapped(self, slots: list[Slot]) -> None:
        """``run`` overlapped: the window enqueued, the tokens of the one in flight taken, then this
        window's sampling enqueued for its rows still generating (a window that could not be enqueued
        runs as ``decode`` does, after the tokens). A row at the end of the context ends with the
        token in flight, so it is left out. The counters are read (``_read_counters``) when a request
        ended, when nothing is left in flight, and every ``TELEMETRY_WINDOWS`` windows."""
        if not slots and not self._runner.in_flight:
            return
        start = time.perf_counter()
        rows = [s for s in slots if s.job.session.n_tokens < self.max_context or not self._runner.carries(s.job)]
        results, queued = self._runner.decode_overlapped([s.job for s in rows])
        if queued:
            self._uncounted.update((id(s.job), s.job) for s in rows)
        fed = {id(s.job) for s in rows} if queued else set()
        held = {id(s.job): s for s in self._slots.busy()}
        ended = False
        for job, result in results:
            slot = held.get(id(job))
            if slot is not None:  # else the request left (cancelled) while its token was in flight
                self._take([slot], [result], None, job.session.n_tokens - 1 if id(job) in fed else None)
                ended |= slot.job is not job
        live = [s for s in rows if s.job is not None and s.job.pending >= 0]
        if queued:
            generating = {id(s.job) for s in live}
            self._runner.sample_in_flight(lambda job: id(job) in generating)
            self.stats.windows += 1
        elif live:
            self._take(live, self._runner.decode([s.job for s in live]), self._runner.telemetry)
            self.stats.windows += 1
        if ended or not self._runner.in_flight or self._runner.unread >= TELEMETRY_WINDOWS:
            self._read_counters()
        self.stats.decode_seconds += time.perf_counter() - start

    def _speculative(self, slots: list[Slot]) -> None:
        """``run`` with drafts (strata_core.serving.speculation): each request that takes them has its
        pending token and its drafted ones as rows of the window, each row drawn as the request's draw at
        that token would be (the same seed and step); it keeps the drafts its draws equal and the draw
        after them, so its text is the one without drafts; its session is cut back past them."""
        rows: list[Any] = []
        plan = []  # (slot, its first row, its drafts, its positions and its sampler's step before the window)
        for slot in slots:
            drafts = self._drafts(slot.job)
            plan.append((slot, len(rows), drafts, slot.job.session.n_tokens, slot.job.sampler.step))
            rows += [slot.job] + _draft_rows(slot.job, drafts)
        start, before = time.perf_counter(), self._runner.telemetry
        results = self._runner.decode(rows)
        for slot, at, drafts, held, step in plan:
            job, mine = slot.job, results[at:at + 1 + len(drafts)]
            failed = next((r for r in mine if isinstance(r, Exception)), None)
            if failed is not None or not drafts:
                self._take([slot], [failed or mine[0]], before)
                continue
            kept = accepted(drafts, [r.token for r in mine])
            job.pacer.record(len(drafts), kept)
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += kept
            job.timings.draft_n += len(drafts)
            job.timings.draft_n_accepted += kept
            job.session.truncate(held + 1 + kept)  # the pending token and the drafts kept
            job.sampler.step = step + kept + 1  # one draw a token taken, as without drafts
            for i, result in enumerate(mine[:kept + 1]):
                self._take([slot], [result], before if i == 0 else None, held + 1 + i)
                if slot.job is not job:  # it ended with this token: its session holds the ones before it
                    if slot.session is job.session:
                        job.session.truncate(held + 1 + i)
                    break
        self.stats.windows += 1
        self.stats.decode_seconds += time.perf_counter() - start

    def _drafts(self, job: Any) -> list[int]:
        """The tokens drafted for ``job``'s window: none for a request with a grammar or log-probabilities
        (each draw's own state) or in a pause after its drafts missed (``DraftPacer``), at most
        ``spec_tokens``, what its context holds and one fewer than the tokens it may still generate (the
        window's last token is always its own)."""
        if not job.pacer.drafts_now():
            self.stats.paused_windows += 1
            return []
        p = job.sampler.params
        room = min(self.spec_tokens, self.max_context - job.session.n_tokens - 1)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - job.stream.generated - 1)
        if room <= 0 or job.sampler.constraint is not None or p.logprobs is not None:
            return []
        if job.drafter is None:
            job.drafter = self._new_drafter(job)
        return job.drafter.draft(room)

    def _new_drafter(self, job: Any) -> Drafter:
        """``job``'s drafter, from its tokens so far."""
        if self._mtp is not None:
            return MtpDrafter(self._mtp, job.session, job.history)
        return NgramDrafter(job.history)

    def _read_counters(self) -> None:
        """Read the engine's counters; each request of the overlapped windows since the last read is
        credited their difference (its decode expert counts: those of the reads its windows fell in)."""
        before = self._counted or self._runner.telemetry
        after = self._runner.read_telemetry() if self._runner.unread else self._runner.telemetry
        for job in self._uncounted.values():
            job.timings.decode_experts.add(before, after)
        self._uncounted.clear()
        self._counted = after

    def _take(self, slots: list[Slot], results: list[SampleResult | Exception], before: dict[str, Any] | None,
              held: int | None = None) -> None:
        """Each slot's request takes its result or fails alone (``held``: ``_accept``'s); ``before``: the
        counters before the window, whose difference each request is credited (None: not here)."""
        for slot, result in zip(slots, results):
            try:
                if isinstance(result, Exception):
                    raise result
                if before is not None:
                    slot.job.timings.decode_experts.add(before, self._runner.telemetry)
                self._accept(slot, result, held)
            except Exception as exc:  # noqa: BLE001 - one request's failure ends only that request
                self._fail(slot, exc)
