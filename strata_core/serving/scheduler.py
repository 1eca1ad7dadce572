"""Continuous batching: request slots, decode windows, a bounded queue, the conversation cache.

All engine calls run on one worker thread (the engine is not thread-safe). The asyncio side
submits a :class:`GenerationRequest` and reads :class:`Delta` / :class:`Finished` events from the
returned :class:`RequestHandle`; the worker hands events over with ``loop.call_soon_threadsafe``.

Each loop of the worker: take new requests and cancellations, start at most one waiting request
in a free slot (prefix reuse + prefill + its first token), then run one decode window over every
active slot. A request therefore joins and leaves between windows. A finished request leaves its
session in the slot, so the next prompt that shares its prefix computes only the new part; a slot
taken by another request first saves its session in the :class:`~strata_core.serving.conv_cache.ConvCache`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from strata_core.serving.compute_thread import ComputeThread
from strata_core.serving.conv_cache import ConvCache, common_prefix
from strata_core.serving.model_files import ModelFileChangedError, ModelFiles
from strata_core.errors import RequestError, StrataError
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
    TokenLogprob,
)
from strata_core.serving.sampling import SampleResult, Sampler, sample_rows
from strata_core.serving.stop_strings import StopMatcher

__all__ = ["RequestHandle", "Scheduler"]

log = logging.getLogger(__name__)


class RequestHandle:
    """The asyncio side of one request: iterate its events, or cancel it."""

    def __init__(self, scheduler: Scheduler, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduler = scheduler
        self.loop = loop
        self.events: asyncio.Queue[Delta | Finished | BaseException] = asyncio.Queue()
        self.cancelled = False

    def cancel(self) -> None:
        """Stop generating; the slot is freed before the next window."""
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


@dataclass
class _Job:
    """Worker-side state of one request."""

    request: GenerationRequest
    handle: RequestHandle
    sampler: Sampler
    decoder: Any
    stop: StopMatcher
    history: list[int]
    session: Any = None
    pending: int = -1  # the sampled token the next window feeds
    generated: int = 0
    timings: Timings = field(default_factory=Timings)
    decode_start: float = 0.0


@dataclass
class _Slot:
    session: Any = None  # live session: the running job's, or an idle one kept for prefix reuse
    job: _Job | None = None
    last_used: int = 0


class Scheduler:
    """``parallel`` slots batched per decode window, a queue of ``max_queue``, a conversation cache."""

    def __init__(self, engine: Any, *, parallel: int, max_queue: int, conv_cache: int, conv_cache_bytes: int,
                 worker: ComputeThread | None = None) -> None:
        self.engine = engine
        self.max_context: int = engine.max_context
        self.parallel = parallel
        self.max_queue = max_queue
        self.cache = ConvCache(conv_cache, conv_cache_bytes)
        self.stats = SchedulerStats()
        # The engine's counters as last read by the worker (after every engine call that moves
        # them): the base of the next request's figures, and what /metrics shows.
        self.telemetry: dict[str, Any] = dict(engine.telemetry.snapshot())
        self.experts_by_device: dict[str, dict[str, int]] = engine.telemetry.by_device()
        self._slots = [_Slot() for _ in range(parallel)]
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._clock = 0
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
            raise ContextLengthError(f"the prompt has {n} tokens but the context holds {self.max_context}")
        handle = RequestHandle(self, asyncio.get_running_loop())
        decoder = self.engine.tokenizer.stream_decoder(skip_special_tokens=not request.keep_special_tokens)
        job = _Job(request, handle, Sampler(request.params), decoder, StopMatcher(request.params.stop),
                   list(request.prompt))
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
        for i, slot in enumerate(self._slots):
            job, session = slot.job, slot.session
            out.append({"id": i, "is_processing": job is not None, "n_ctx": self.max_context,
                        "n_tokens": session.n_tokens if session is not None else 0,
                        "n_prompt_tokens": len(job.request.prompt) if job else 0,
                        "n_decoded": job.generated if job else 0})
        return out

    def _wake(self) -> None:
        self._inbox.put(None)

    # --- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            busy = self._waiting or any(s.job for s in self._slots)
            self._take_inbox(block=not busy)
            try:
                self._drop_cancelled()
                self._check_files()
                if self._drain_deadline is not None:
                    self._end_for_shutdown()
                self._admit()
                self._window()
            except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
                log.exception("scheduler step failed")
                for slot in [s for s in self._slots if s.job]:
                    self._fail_in_slot(slot, exc)
            self.stats.active = sum(1 for s in self._slots if s.job)
            self.stats.waiting = len(self._waiting)
        self._shutdown()

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
        for slot in self._slots:
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
            for slot in [s for s in self._slots if s.job]:
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
        for job in [j for j in self._waiting if j.handle.cancelled]:
            self._waiting.remove(job)
            self._end(job, None)
        for slot in self._slots:
            if slot.job and slot.job.handle.cancelled:
                self._end(slot.job, None)
                self._free(slot)

    def _admit(self) -> None:
        """Start the oldest waiting request in a free slot: reuse a prefix, prefill, sample."""
        idle = [s for s in self._slots if s.job is None]
        if not self._waiting or not idle:
            return
        job = self._waiting.popleft()
        prompt = job.request.prompt
        slot = None
        try:
            slot, cached = self._place(job, idle)
            start = time.perf_counter()
            before = self.telemetry
            logits = self.engine.prefill(job.session, prompt[cached:])
            job.timings.prompt_experts.add(before, self._read_telemetry())
            t = job.timings
            t.cache_n, t.prompt_n = cached, len(prompt) - cached
            t.prompt_ms = (time.perf_counter() - start) * 1000.0
            job.decode_start = time.perf_counter()
            self._accept(job, job.sampler.sample_result(logits, job.history))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
            self._read_telemetry()
            if slot is not None:
                self._fail_in_slot(slot, exc)
            else:
                self._fail(job, exc)
        else:
            if job.pending < 0:  # done after its first token
                self._free(slot)

    def _place(self, job: _Job, idle: list[_Slot]) -> tuple[_Slot, int]:
        """Give ``job`` an idle slot and a session holding the longest known prefix of its prompt."""
        prompt = job.request.prompt
        rewindable = self.engine.spec.rewindable  # else a held state is reused whole or not at all
        live, live_n = idle[0], 0
        for s in idle:  # a session is reused in place when it is mostly this prompt's prefix
            if s.session is None:
                continue
            n = common_prefix(s.session.tokens, prompt[:-1])
            if n > live_n and 2 * n >= s.session.n_tokens and (rewindable or n == s.session.n_tokens):
                live, live_n = s, n
        key, cache_n = self.cache.best(prompt[:-1], whole=not rewindable)
        if live_n > 0 and live_n >= cache_n:
            slot, cached = live, live_n
        else:
            # Taken before displacing can evict it. A conversation used in full moves into the slot
            # (it is put back, grown, when displaced); one sharing only a prefix with this prompt
            # stays cached whole, else a shared chat-template opening would cut it to those tokens.
            snapshot = None
            if key is not None:
                whole = cache_n == self.cache.n_tokens(key)
                snapshot = self.cache.take(key) if whole else self.cache.peek(key)
            slot = min(idle, key=lambda s: (s.session is not None, s.last_used))
            self._displace(slot)
            if snapshot is not None:
                slot.session, cached = self.engine.restore_session(snapshot), cache_n
            else:
                slot.session, cached = self.engine.new_session(), 0
        if slot.session.n_tokens > cached:  # the last prompt token is always computed, for its logits
            slot.session.truncate(cached)
        slot.job, job.session = job, slot.session
        return slot, cached

    def _displace(self, slot: _Slot) -> None:
        """Free the slot's idle session, keeping a snapshot in the conversation cache."""
        if slot.session is None:
            return
        if slot.session.n_tokens and self.cache.max_entries:
            self.cache.put(list(slot.session.tokens), self.engine.save_session(slot.session))
        self._drop_session(slot)

    def _drop_session(self, slot: _Slot) -> None:
        if slot.session is not None:
            self.engine.release_session(slot.session)
            slot.session = None

    def _window(self) -> None:
        """One decode step for every active slot."""
        jobs = [s.job for s in self._slots if s.job]
        if not jobs:
            return
        before = [j.session.n_tokens for j in jobs]
        start = time.perf_counter()
        counters = self.telemetry
        logits = None
        try:
            logits = self.engine.decode_window([(j.session, j.pending) for j in jobs])
            rows = list(zip(jobs, logits))
        except Exception:  # noqa: BLE001 - retry alone to find the failing request
            log.exception("decode window of %d failed; retrying each request alone", len(jobs))
            rows = self._isolate(jobs, before)
        after = self._read_telemetry()
        for job, _ in rows:
            job.timings.decode_experts.add(counters, after)
        self.stats.windows += 1
        self.stats.decode_seconds += time.perf_counter() - start
        for (job, _), result in zip(rows, self._sample(rows, logits if len(rows) == len(jobs) else None)):
            try:
                if isinstance(result, Exception):
                    raise result
                self._accept(job, result)
            except Exception as exc:  # noqa: BLE001 - one request's failure ends only that request
                self._fail_in_slot(next(s for s in self._slots if s.job is job), exc)
        for slot in self._slots:
            if slot.job and slot.job.pending < 0:
                self._free(slot)

    def _read_telemetry(self) -> dict[str, Any]:
        """Read the engine's counters (once per engine call that moves them) and keep them, with the
        expert groups each device slot served by source (``experts_by_device``, for ``/metrics``)."""
        self.telemetry = dict(self.engine.telemetry.snapshot())
        self.experts_by_device = self.engine.telemetry.by_device()
        return self.telemetry

    def _isolate(self, jobs: list[_Job], before: list[int]) -> list[tuple[_Job, torch.Tensor]]:
        rows = []
        for job, n in zip(jobs, before):
            try:
                if job.session.n_tokens != n:
                    raise RuntimeError("the decode window failed after this request's step")
                if not self.engine.spec.rewindable:  # a retry would advance the state a second time
                    raise RuntimeError("the decode window failed after some layers updated this request's "
                                       "recurrent state")
                rows.append((job, self.engine.decode_window([(job.session, job.pending)])[0]))
            except Exception as exc:  # noqa: BLE001
                self._fail_in_slot(next(s for s in self._slots if s.job is job), exc)
        return rows

    def _sample(self, rows: list[tuple[_Job, torch.Tensor]], logits: torch.Tensor | None) -> list[SampleResult | Exception]:
        """Every row's next token in one call on the logits' device (``logits`` is the window's
        ``[B, V]`` tensor when every job has a row); if the call itself fails, row by row, so a
        failure ends only the requests it belongs to."""
        if not rows:
            return []
        try:
            stacked = logits if logits is not None else torch.stack([row for _, row in rows])
            return sample_rows(stacked, [(job.sampler, job.history) for job, _ in rows])
        except Exception:  # noqa: BLE001
            log.exception("sampling a window of %d failed; sampling each row alone", len(rows))
            out: list[SampleResult | Exception] = []
            for job, row in rows:
                try:
                    out.append(job.sampler.sample_result(row, job.history))
                except Exception as exc:  # noqa: BLE001
                    out.append(exc)
            return out

    def _accept(self, job: _Job, result: SampleResult) -> None:
        """Take the sampled token: give out its text, decide whether to go on."""
        token = result.token
        job.history.append(token)
        job.generated += 1
        lps = [] if result.logprob is None else [self._logprob(result)]
        eos = token in self.engine.tokenizer.eos_token_ids
        text, stopped = job.stop.push("" if eos else job.decoder.push(token))
        limit = job.request.params.max_tokens
        full = (limit is not None and job.generated >= limit) or job.session.n_tokens >= self.max_context
        reason = "stop" if eos or stopped else "length" if full else ""
        if reason and not stopped:  # give out what the decoder and the stop matcher hold back
            tail, stopped = job.stop.push(job.decoder.flush())
            text += tail if stopped else tail + job.stop.held
            reason = "stop" if stopped else reason
        job.pending = -1 if reason else token
        if text or lps:
            self._emit(job, Delta(text, [token], lps))
        if reason:
            self._end(job, reason)

    def _logprob(self, result: SampleResult) -> TokenLogprob:
        decode = self.engine.tokenizer.decode
        alts = [(i, decode([i]), v) for i, v in result.top_logprobs]
        return TokenLogprob(result.token, decode([result.token]), float(result.logprob), alts)

    def _end(self, job: _Job, reason: str | None) -> None:
        """Send Finished (RequestCancelled for a cancelled request) and count the request out."""
        with self._lock:
            self._in_flight -= 1
        if reason is None:
            self.stats.cancelled += 1
            self._emit(job, RequestCancelled("the request was cancelled"))
            return
        t = job.timings
        t.predicted_n = job.generated
        t.predicted_ms = (time.perf_counter() - job.decode_start) * 1000.0
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(job.request.prompt)
        s.cached_tokens += t.cache_n
        s.completion_tokens += job.generated
        s.prompt_seconds += t.prompt_ms / 1000.0
        log.info("request done: %s, finish %s", t.summary(), reason)
        self._emit(job, Finished(reason, len(job.request.prompt), job.generated, t))

    def _fail(self, job: _Job, exc: Exception) -> None:
        if not isinstance(exc, StrataError):
            log.error("request failed", exc_info=exc)
        with self._lock:
            self._in_flight -= 1
        self.stats.failed += 1
        self._emit(job, exc)

    def _fail_in_slot(self, slot: _Slot, exc: Exception) -> None:
        """Fail the slot's job and drop its session (its state is unknown after the failure)."""
        job, slot.job = slot.job, None
        if job is not None:
            self._fail(job, exc)
        self._drop_session(slot)

    def _free(self, slot: _Slot) -> None:
        """The slot's job left; its session stays for prefix reuse."""
        slot.job = None
        self._clock += 1
        slot.last_used = self._clock

    def _emit(self, job: _Job, event: Delta | Finished | BaseException) -> None:
        try:
            job.handle.loop.call_soon_threadsafe(job.handle.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            job.handle.cancelled = True

    def _shutdown(self) -> None:
        jobs = list(self._waiting) + [s.job for s in self._slots if s.job]
        for job in jobs:
            self._fail(job, RuntimeError("the server is shutting down"))
        for slot in self._slots:
            slot.job = None
            self._drop_session(slot)
