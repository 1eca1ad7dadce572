"""Continuous batching in steps: request slots, a token budget per step, a bounded queue.

All engine calls run on one worker thread (the engine is not thread-safe). The asyncio side
submits a :class:`GenerationRequest` and reads :class:`Delta` / :class:`Finished` events from the
returned :class:`RequestHandle`; the worker hands events over with ``loop.call_soon_threadsafe``.

Each loop of the worker is one step: take new requests and cancellations, give the free slots to
the oldest waiting requests (:mod:`~strata_core.serving.slots`: prefix reuse, the conversation
cache), then run what :func:`~strata_core.serving.step_plan.plan_step` plans under ``step_tokens``:
one decode window over every slot that decodes, then prompt chunks of the slots still prefilling,
oldest first, in one prompt batch (one pass over the experts for all of them; one by one for a
model whose recurrent state cannot be rewritten), run and sampled by
:class:`~strata_core.serving.step_runner.StepRunner`. The last
chunk of a prompt samples its first token; the slot decodes from the next step on.
:class:`~strata_core.serving.streams.TokenStream` turns each sampled token into text and says when
the request is done. A request joins and leaves between steps, and a failure in one request's chunk
or row ends only that request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from strata_core.errors import RequestError, StrataError
from strata_core.serving.compute_thread import ComputeThread
from strata_core.serving.conv_cache import ConvCache
from strata_core.serving.model_files import ModelFileChangedError, ModelFiles
from strata_core.serving.requests import (
    ContextLengthError,
    Delta,
    Finished,
    GenerationRequest,
    RequestCancelled,
    SchedulerStats,
    ServerBusyError,
    ShuttingDownError,
    Timings,
)
from strata_core.serving.sampling import Sampler, SampleResult
from strata_core.serving.slots import Slot, Slots
from strata_core.serving.step_plan import plan_step
from strata_core.serving.speculation import DraftPacer, Drafter
from strata_core.serving.step_runner import StepRunner
from strata_core.serving.streams import TokenStream
from strata_core.serving.windows import DecodeWindows

__all__ = ["RequestHandle", "Scheduler"]

log = logging.getLogger(__name__)


class RequestHandle:
    """The asyncio side of one request: iterate its events, or cancel it; ``prompt_tokens`` counts its
    prompt (what a stream's opening event reports before the request finishes); ``opens_in_reasoning``:
    the reply starts inside a ``<think>`` block its prompt opened (set by the chat service)."""

    def __init__(self, scheduler: Scheduler, loop: asyncio.AbstractEventLoop, prompt_tokens: int) -> None:
        self._scheduler = scheduler
        self.loop = loop
        self.prompt_tokens = prompt_tokens
        self.events: asyncio.Queue[Delta | Finished | BaseException] = asyncio.Queue()
        self.cancelled = False
        self.opens_in_reasoning = False

    def cancel(self) -> None:
        """Stop generating; the slot is freed before the next step."""
        if not self.cancelled:
            self.cancelled = True
            self._scheduler._wake()

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        """Deltas, then one Finished; raises the request's error if it failed."""
        while True:
            event = await self.events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                return


@dataclass(eq=False)
class _Job:
    """Worker-side state of one request."""

    request: GenerationRequest
    handle: RequestHandle
    sampler: Sampler
    stream: TokenStream
    history: list[int]
    session: Any = None
    pending: int = -1  # the sampled token the next window feeds; -1 while the prompt is computed
    admitted: int = 0  # admission order: an older request's prompt chunks run first
    timings: Timings = field(default_factory=Timings)
    decode_start: float = 0.0
    drafter: Drafter | None = None  # its drafts' source, made at its first speculative window
    pacer: DraftPacer = field(default_factory=DraftPacer)  # whether its windows draft (pauses after misses)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet in the session."""
        return len(self.request.prompt) - self.session.n_tokens


class Scheduler:
    """``parallel`` slots run in steps of at most ``step_tokens`` tokens (``step_tokens >= parallel``),
    a queue of ``max_queue``, a conversation cache of ``conv_cache`` entries and ``conv_cache_bytes``;
    ``overlap``: each decode window enqueued before the one before it has given its tokens to the host
    (for a model whose state can be rewound, without speculation); ``spec_tokens``: speculative decoding
    with up to that many drafted tokens a window (strata_core.serving.speculation), ``drafts`` "ngram"
    (prompt lookup) or "mtp" (the engine's MTP block: strata_core.serving.mtp_drafts)."""

    def __init__(self, engine: Any, *, parallel: int, max_queue: int, conv_cache: int, conv_cache_bytes: int,
                 step_tokens: int, worker: ComputeThread | None = None, overlap: bool = True,
                 spec_tokens: int = 0, drafts: str = "ngram") -> None:
        self.engine = engine
        self.max_context: int = engine.max_context
        self.parallel = parallel
        self.max_queue = max_queue
        self.step_tokens = step_tokens
        # A step with no decode row keeps no stream waiting: its prompt chunks may be the engine's own.
        self._idle_tokens: int = engine.settings.prefill_chunk
        # under --batch-invariant a prompt's chunks do not depend on the other requests (step_plan)
        self._piece = step_tokens - parallel + 1 if engine.settings.batch_invariant else 0
        self.cache = ConvCache(conv_cache, conv_cache_bytes)
        self.stats = SchedulerStats()
        self._runner = StepRunner(engine)
        self._slots = Slots(engine, parallel, self.cache)
        self._windows = DecodeWindows(self._runner, self._slots, self.stats, self.max_context, engine.spec.rewindable,
                                      overlap, spec_tokens, self._accept, self._fail_in_slot, drafts)
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._outbox: list[tuple[RequestHandle, Any]] = []  # events for the handles, passed on by _hand_over
        self._admissions = itertools.count()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stopping = False
        self._drain_deadline: float | None = None  # set by drain(): running requests end by then
        gguf = getattr(engine, "gguf_file", None)
        self._files = ModelFiles(gguf.parts or [gguf.path], on_break=self._wake) if gguf is not None else None
        self.broken: ModelFileChangedError | None = None  # set once a model file changed: nothing runs
        # The worker loop runs on ``worker`` (the thread that loaded the engine), else on its own.
        self._owns_worker = worker is None
        self._worker = worker
        self._loop_done: concurrent.futures.Future[Any] | None = None

    # --- asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker loop on the compute thread."""
        if self._worker is None:
            self._worker = ComputeThread(name="strata-scheduler")
        self._loop_done = self._worker.submit(self._run)

    @property
    def telemetry(self) -> dict[str, Any]:
        """The engine's counters as read after its last call (the base of a request's figures; /metrics)."""
        return self._runner.telemetry

    @property
    def experts_by_device(self) -> dict[str, dict[str, int]]:
        """The expert groups each device slot served, by source, as last read (/metrics)."""
        return self._runner.experts_by_device

    @property
    def kv_blocks(self) -> dict[str, int]:
        """The KV pools' cached-block counters: taken back, evicted, cached now (kvpool.py; /metrics)."""
        return self.engine.kv_pools.counters()

    @property
    def worker(self) -> ComputeThread | None:
        """The thread every engine call runs on."""
        return self._worker

    def stop(self) -> None:
        """Fail what is left, release every session and end the worker loop (and its thread if owned)."""
        self._stopping = True
        self._wake()
        if self._loop_done is not None:
            self._loop_done.result()
        if self._owns_worker and self._worker is not None:
            self._worker.close()
        if self._files is not None:
            self._files.close()

    def drain(self, grace: float) -> None:
        """Admit nothing more: the queued requests fail now, the running ones in ``grace`` seconds
        (with ShuttingDownError) unless they finish first."""
        self._drain_deadline = time.monotonic() + grace
        self._wake()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; raises RequestError if it cannot run, ServerBusyError if the queue is full."""
        if self._drain_deadline is not None:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        if self.broken is not None:
            raise self.broken
        n = len(request.prompt)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n > self.max_context:
            raise ContextLengthError(f"the prompt has {n} tokens but the context holds {self.max_context}", n,
                                     self.max_context)
        handle = RequestHandle(self, asyncio.get_running_loop(), n)
        job = _Job(request, handle, Sampler(request.params, request.constraint),
                   TokenStream(self.engine.tokenizer, request), list(request.prompt))
        with self._lock:  # counted last: nothing can fail between counting and queueing
            if self._in_flight >= self.parallel + self.max_queue:
                raise ServerBusyError(
                    f"the server is busy: {self.parallel} slots and {self.max_queue} queued requests are taken; retry later"
                )
            self._in_flight += 1
        self._inbox.put(job)
        return handle

    def slot_states(self) -> list[dict[str, Any]]:
        """Per slot (read from any thread): id, whether it generates, tokens held, the job's progress."""
        out = []
        for i, slot in enumerate(self._slots.all):
            job, session = slot.job, slot.session
            out.append({"id": i, "is_processing": job is not None, "n_ctx": self.max_context,
                        "n_tokens": session.n_tokens if session is not None else 0,
                        "n_prompt_tokens": len(job.request.prompt) if job else 0,
                        "n_decoded": job.stream.generated if job else 0})
        return out

    def _wake(self) -> None:
        self._inbox.put(None)

    # --- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            busy = self._waiting or self._slots.busy()
            self._take_inbox(block=not busy)
            try:
                self._drop_cancelled()
                self._check_files()
                if self._drain_deadline is not None:
                    self._end_for_shutdown()
                self._step()
            except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
                log.exception("scheduler step failed")
                for slot in self._slots.busy():
                    self._fail_in_slot(slot, exc)
            self._hand_over()
            self.stats.active = len(self._slots.busy())
            self.stats.waiting = len(self._waiting)
        self._shutdown()
        self._hand_over()

    def _step(self) -> None:
        """Admit, then run the plan: one decode window, then the prompt chunks, oldest request first."""
        self._admit()
        busy = self._slots.busy()
        prefilling = sorted((s for s in busy if s.job.pending < 0), key=lambda s: s.job.admitted)
        plan = plan_step([s for s in busy if s.job.pending >= 0], [(s, s.job.prompt_left) for s in prefilling],
                         self.step_tokens, self._idle_tokens, self._piece)
        self._window(list(plan.decode))
        # a rewindable model's chunks run as one prompt batch (one pass over the experts for all); one by
        # one where a recurrent state cannot be rewritten after a failed batch, or under --batch-invariant
        # (on CUDA a product's rows may depend on how many rows share it), then a pass a piece (step_plan)
        together = self.engine.spec.rewindable and not self.engine.settings.batch_invariant
        piece = self._piece
        batches = [list(plan.chunks)] if together else [[(slot, min(piece or n, n - at))] for slot, n in plan.chunks
                                                        for at in range(0, n, piece or n)]
        for chunks in batches:
            if live := [(slot, n) for slot, n in chunks if slot.job is not None]:  # not failed in an earlier piece
                self._prefill(live)
        if busy:
            self.stats.steps += 1

    def _check_files(self) -> None:
        """Before any step: if a model file changed, fail everything and run nothing more."""
        if self._files is None or self.broken is None and (problem := self._files.changed()) is None:
            return
        if self.broken is None:
            self.broken = problem
            log.error("%s", problem)
        for job in list(self._waiting):
            self._waiting.remove(job)
            self._fail(job, self.broken)
        for slot in self._slots.all:
            if slot.job:
                job, slot.job = slot.job, None
                self._fail(job, self.broken)
            slot.session = None  # never touched again: releasing it could read the changed file
        self._files.release()  # only now may a writer waiting on a lease go on: nothing reads the file

    def _end_for_shutdown(self) -> None:
        """While draining: fail the queued requests, and the running ones once the grace is over."""
        for job in list(self._waiting):
            self._waiting.remove(job)
            self._fail(job, ShuttingDownError("the server is shutting down; the request was not started"))
        if time.monotonic() >= self._drain_deadline:  # type: ignore[operator]
            for slot in self._slots.busy():
                self._fail_in_slot(slot, ShuttingDownError("the server is shutting down; the request was ended "
                                                           "before it finished"))

    def _take_inbox(self, block: bool) -> None:
        try:
            if not block:
                item = self._inbox.get_nowait()
            elif self._files is not None and self._files.leased:  # a missed SIGIO is seen within 1 s
                item = self._inbox.get(timeout=1.0)
            else:
                item = self._inbox.get()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        """End the cancelled requests. A decoding one leaves its session for prefix reuse; one cut in
        the middle of its prompt releases it, so its memory is free for the next step."""
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._end(job, None)
        for slot in self._slots.busy():
            if slot.job.handle.cancelled:
                prefilling = slot.job.pending < 0
                self._end(slot.job, None)
                self._slots.free(slot)
                if prefilling:
                    self._slots.drop(slot)

    def _admit(self) -> None:
        """Give the free slots to the oldest waiting requests; their prompts run in the coming steps."""
        idle = self._slots.idle()
        while self._waiting and idle:
            job = self._waiting.popleft()
            try:
                slot = self._slots.place(job.request.prompt, idle)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail(job, exc)
                continue
            idle.remove(slot)
            slot.job, job.session = job, slot.session
            job.admitted = next(self._admissions)
            job.timings.cache_n = slot.session.n_tokens
            if job.prompt_left == 1 and slot.session.n_tokens:  # the rest was kept: the last token rides the
                job.pending = job.request.prompt[-1]  # next window instead of a prompt pass of its own
                job.decode_start = time.perf_counter()

    def _prefill(self, chunks: list[tuple[Slot, int]]) -> None:
        """Compute the next ``n`` prompt tokens of each slot's request in one prompt batch; after a
        prompt's last, sample its first token. Each request is credited the whole batch's time."""
        work = []
        for slot, n in chunks:
            job = slot.job
            done = job.session.n_tokens
            work.append((job, job.request.prompt[done:done + n], n == job.prompt_left))
        self._windows.before_prompts()
        start, before = time.perf_counter(), self._runner.telemetry
        results = self._runner.prefill(work)
        self._windows.after_prompts()
        seconds = time.perf_counter() - start
        self.stats.prefill_seconds += seconds
        for (slot, n), result in zip(chunks, results):
            try:
                if isinstance(result, Exception):
                    raise result
                t = slot.job.timings
                t.prompt_experts.add(before, self._runner.telemetry)
                t.prompt_n += n
                t.prompt_ms += seconds * 1000.0
                if result is not None:
                    slot.job.decode_start = time.perf_counter()
                    self._accept(slot, result)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                self._fail_in_slot(slot, exc)

    def _window(self, slots: list[Slot]) -> None:
        """One decode window for ``slots`` (``DecodeWindows``); its tokens go out before the step's prompt
        chunks run."""
        self._windows.run(slots)
        self._hand_over()

    def _accept(self, slot: Slot, result: SampleResult, held: int | None = None) -> None:
        """Take the slot's sampled token: give out its text; a finished request leaves the slot (``held``:
        the positions its session holds before the token, when they are not ``n_tokens``: a window in
        flight or a speculative one holds more)."""
        job = slot.job
        job.history.append(result.token)
        if job.drafter is not None:
            job.drafter.extend([result.token])
        held = job.session.n_tokens if held is None else held
        delta, reason = job.stream.push(result, context_full=held >= self.max_context)
        job.pending = -1 if reason else result.token
        if delta is not None:
            self._emit(job, delta)
        if reason:
            self._end(job, reason)
            self._slots.free(slot)

    def _end(self, job: _Job, reason: str | None) -> None:
        """Send Finished (RequestCancelled for a cancelled request) and count the request out."""
        with self._lock:
            self._in_flight -= 1
        if reason is None:
            self.stats.cancelled += 1
            self._emit(job, RequestCancelled("the request was cancelled"))
            return
        t = job.timings
        t.predicted_n = job.stream.generated
        t.predicted_ms = (time.perf_counter() - job.decode_start) * 1000.0
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(job.request.prompt)
        s.cached_tokens += t.cache_n
        s.completion_tokens += job.stream.generated
        s.prompt_seconds += t.prompt_ms / 1000.0
        log.info("request done: %s, finish %s", t.summary(), reason)
        self._emit(job, Finished(reason, len(job.request.prompt), job.stream.generated, t,
                                 job.stream.stop_word))

    def _fail(self, job: _Job, exc: Exception) -> None:
        if not isinstance(exc, StrataError):
            log.error("request failed", exc_info=exc)
        with self._lock:
            self._in_flight -= 1
        self.stats.failed += 1
        self._emit(job, exc)

    def _fail_in_slot(self, slot: Slot, exc: Exception) -> None:
        """Fail the slot's job and drop its session (its state is unknown after the failure)."""
        job, slot.job = slot.job, None
        if job is not None:
            self._fail(job, exc)
        self._slots.drop(slot)

    def _emit(self, job: _Job, event: Delta | Finished | BaseException) -> None:
        """Queue ``event`` for the job's handle; ``_hand_over`` passes the queued events on."""
        self._outbox.append((job.handle, event))

    def _hand_over(self) -> None:
        """Give the queued events to their event loops: one call per loop, not one per event (each call
        wakes the loop through its self-pipe, and the loop's thread competes with this one for the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Any]]] = {}
        for handle, event in self._outbox:
            by_loop.setdefault(handle.loop, []).append((handle, event))
        self._outbox.clear()
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the event loop is closed: nobody is listening
                for handle, _ in events:
                    handle.cancelled = True

    def _shutdown(self) -> None:
        jobs = list(self._waiting) + [s.job for s in self._slots.busy()]
        for job in jobs:
            self._fail(job, RuntimeError("the server is shutting down"))
        for slot in self._slots.all:
            slot.job = None
            self._slots.drop(slot)


def _deliver(events: list[tuple[RequestHandle, Any]]) -> None:
    """On the event loop: put each event on its handle's queue, in order."""
    for handle, event in events:
        handle.events.put_nowait(event)
