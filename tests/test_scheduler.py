"""The scheduler on the fake engine: batching keeps tokens, queue bound, cancel, failures, context, cache,
and the steps: long prompts in chunks beside decoding streams, cancels and failures in the middle of a prompt."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from test_server_support import FakeBlocks, FakeEngine, FakeTokenizer, greedy_reference, steps_of

from strata_core.config import StrataSettings
from strata_core.serving.requests import (ContextLengthError, Delta, Finished, GenerationRequest, RequestCancelled,
                                          ServerBusyError)
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import RequestHandle, Scheduler


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _request(text: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(FakeTokenizer().encode(text), _greedy(max_tokens))


async def _run(handle: RequestHandle) -> tuple[list[int], str, Finished]:
    tokens, text, end = [], "", None
    async for event in handle:
        if isinstance(event, Delta):
            tokens += event.tokens
            text += event.text
        else:
            end = event
    assert end is not None
    return tokens, text, end


def _scheduler(engine: FakeEngine, parallel: int = 2, max_queue: int = 8, conv_cache: int = 0,
               step_tokens: int = 512) -> Scheduler:
    scheduler = Scheduler(engine, parallel=parallel, max_queue=max_queue, conv_cache=conv_cache,
                          conv_cache_bytes=1 << 20, step_tokens=step_tokens)
    scheduler.start()
    return scheduler


def _tokens_alone(request: GenerationRequest) -> list[int]:
    """Every sampled token (EOS included) the request yields run alone; Deltas carry only text-bearing ones."""
    return greedy_reference(request.prompt, request.params.max_tokens)


def test_batched_requests_equal_their_runs_alone() -> None:
    engine = FakeEngine(step_delay=0.001)
    scheduler = _scheduler(engine, parallel=3)
    requests = [_request(f"prompt number {i}", max_tokens=6 + i) for i in range(8)]

    async def main() -> list[tuple[list[int], str, Finished]]:
        return await asyncio.gather(*(_run(scheduler.submit(r)) for r in requests))

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    for request, (tokens, text, end) in zip(requests, results):
        alone = _tokens_alone(request)
        assert tokens == [t for t in alone if t not in FakeTokenizer.eos_token_ids]
        assert text == FakeTokenizer().decode(alone)
        assert end.completion_tokens == len(alone)
        assert end.reason == ("stop" if alone[-1] in FakeTokenizer.eos_token_ids else "length")
    assert max(engine.windows) == 3 and min(engine.windows) >= 1  # windows batched the slots
    assert len(engine.live) <= 3 and scheduler.stats.requests == 8


def test_queue_bound_rejects_with_503_error() -> None:
    scheduler = _scheduler(FakeEngine(step_delay=0.001), parallel=1, max_queue=1)

    async def main() -> None:
        first, second = scheduler.submit(_request("a")), scheduler.submit(_request("b"))
        with pytest.raises(ServerBusyError, match="busy"):
            scheduler.submit(_request("c"))
        await _run(first)
        await _run(second)
        await _run(scheduler.submit(_request("d")))  # room again

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()


def test_cancel_frees_the_slot_at_the_next_window() -> None:
    engine = FakeEngine(max_context=4096, step_delay=0.002)
    scheduler = _scheduler(engine, parallel=1, max_queue=1)

    async def main() -> None:
        long = scheduler.submit(_request("go on", max_tokens=4000))
        assert isinstance(await long.events.get(), Delta)
        long.cancel()
        _, text, end = await asyncio.wait_for(_run(scheduler.submit(_request("next", 4))), 10)
        assert end.completion_tokens <= 4

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    assert scheduler.stats.cancelled == 1 and scheduler.stats.requests == 1


def test_a_failing_request_leaves_the_others_alone() -> None:
    engine = FakeEngine(step_delay=0.001)
    scheduler = _scheduler(engine, parallel=2)
    good = [_request(f"good {i}", 10) for i in range(3)]

    async def main() -> list:
        handles = [scheduler.submit(good[0]), scheduler.submit(_request("bad \u2620")),
                   scheduler.submit(good[1]), scheduler.submit(good[2])]
        return await asyncio.gather(*(_run(h) for h in handles), return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert isinstance(results[1], RuntimeError) and "poisoned" in str(results[1])
    for request, (tokens, _, _) in zip(good, [results[0], results[2], results[3]]):
        assert tokens == [t for t in _tokens_alone(request) if t not in FakeTokenizer.eos_token_ids]
    assert scheduler.stats.failed == 1 and len(engine.live) <= 2


def test_context_limits() -> None:
    engine = FakeEngine(max_context=64)
    scheduler = _scheduler(engine)
    text = next(f"{i:03d}" * 21 for i in range(100)
                if not set(greedy_reference(FakeTokenizer().encode(f"{i:03d}" * 21), 3)) & FakeTokenizer.eos_token_ids)

    async def main() -> Finished:
        with pytest.raises(ContextLengthError, match="65 tokens but the context holds 64"):
            scheduler.submit(_request("x" * 65))
        return (await _run(scheduler.submit(_request(text, max_tokens=50))))[2]

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    assert (end.reason, end.prompt_tokens, end.completion_tokens) == ("length", 63, 2)


@pytest.mark.parametrize("conv_cache", [0, 1, 2])
@pytest.mark.parametrize("rewindable", [True, False])
def test_a_displaced_conversation_s_next_turn_reuses_it(conv_cache: int, rewindable: bool) -> None:
    """The next turn of a displaced conversation: a model without recurrent state takes back the whole
    KV blocks its displaced session left cached on the device (no host snapshot, whatever --conv-cache);
    one with recurrent state restores the whole conversation from the host conversation cache."""
    engine = FakeEngine(step_delay=0.0, rewindable=rewindable)
    scheduler = _scheduler(engine, parallel=1, conv_cache=conv_cache)
    first = _request("first turn", 6)
    reply = [t for t in greedy_reference(first.prompt, 6) if t not in FakeTokenizer.eos_token_ids]
    second = GenerationRequest(first.prompt + reply + FakeTokenizer().encode(" and more"), _greedy(6))

    async def main() -> Finished:
        await _run(scheduler.submit(first))
        await _run(scheduler.submit(_request("something else", 4)))  # takes the only slot
        tokens, _, end = await _run(scheduler.submit(second))
        assert tokens == [t for t in _tokens_alone(second) if t not in FakeTokenizer.eos_token_ids]
        return end

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    if rewindable:  # overlapped windows fed the last reply token to the window after it: all of it is held
        block = engine.kv_pools.block
        cached = (len(first.prompt) + len(reply)) // block * block
        assert len(scheduler.cache) == 0 and scheduler.kv_blocks["hits"] == cached // block
    else:
        cached = len(first.prompt) + len(reply) - 1 if conv_cache else 0
        assert len(scheduler.cache) == (1 if conv_cache else 0)  # "something else" was displaced in turn
    assert end.timings.cache_n == cached > 0 or not conv_cache
    assert end.timings.prompt_n == len(second.prompt) - cached == engine.prefilled[-1]


@pytest.mark.parametrize("rewindable", [True, False])
def test_idle_slot_keeps_its_session_for_the_next_turn(rewindable: bool) -> None:
    """The next turn reuses the prompt part of the idle session; a recurrent state (not rewindable)
    holds the generated tokens too, so it cannot be cut back to the prompt and starts afresh."""
    engine = FakeEngine(rewindable=rewindable)
    scheduler = _scheduler(engine, parallel=2, conv_cache=0)
    first = _request("hello there", 4)

    async def main() -> Finished:
        await _run(scheduler.submit(first))
        return (await _run(scheduler.submit(GenerationRequest(first.prompt + [50, 51], _greedy(2)))))[2]

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    assert end.timings.cache_n == (len(first.prompt) if rewindable else 0)


def test_batch_invariant_reuses_no_prefix() -> None:
    """Under --batch-invariant a returning conversation and a repeated prompt are computed whole: on
    CUDA a prefix computed in other chunks, or a last prompt token run as a decode row, changes bits."""
    engine = FakeEngine()
    engine.settings = StrataSettings(batch_invariant=True)
    scheduler = _scheduler(engine, parallel=1, conv_cache=2)
    first = _request("hello there", 4)

    async def main() -> list[Finished]:
        ends = [(await _run(scheduler.submit(first)))[2]]
        ends.append((await _run(scheduler.submit(_request("something else", 4))))[2])
        return ends + [(await _run(scheduler.submit(GenerationRequest(first.prompt + [50, 51], _greedy(2)))))[2]]

    try:
        ends = asyncio.run(main())
    finally:
        scheduler.stop()
    assert [end.timings.cache_n for end in ends] == [0, 0, 0]
    assert ends[2].timings.prompt_n == len(first.prompt) + 2 == engine.prefilled[-1]


def test_a_prompt_kept_but_its_last_token_runs_that_token_in_the_window() -> None:
    """A repeated prompt finds all but its last token in the idle slot's session: that token is fed by
    the next decode window (no prompt pass of one token), and the tokens are those of the prompt alone."""
    engine = FakeEngine()
    scheduler = _scheduler(engine, parallel=1, conv_cache=0)
    request = _request("the same prompt", 5)

    async def main() -> tuple:
        first = await _run(scheduler.submit(request))
        passes = len(engine.prefilled)
        return first, await _run(scheduler.submit(request)), passes

    try:
        first, again, passes = asyncio.run(main())
    finally:
        scheduler.stop()
    assert again[2].timings.cache_n == len(request.prompt) - 1 and again[2].timings.prompt_n == 0
    assert len(engine.prefilled) == passes  # the second request made no prompt pass
    assert again[0] == first[0] == [t for t in _tokens_alone(request) if t not in FakeTokenizer.eos_token_ids]


@pytest.mark.parametrize("shares", [True, False])
def test_a_prompt_sharing_only_the_template_opening_keeps_the_cached_conversation(shares: bool) -> None:
    """Conversations A, B, C, then A again, one slot: B and C share only the chat template's opening
    with A, and A's next turn still finds all of A: its whole KV blocks cached on the device (an engine
    sharing prefixes, its pool large enough), or A in the conversation cache (one that shares none)."""
    engine = FakeEngine()
    engine.shares_prefixes = shares
    engine.kv_pools = FakeBlocks(capacity=256)
    scheduler = _scheduler(engine, parallel=1, conv_cache=8)
    opening = "<|im_start|>user\n"
    a, b, c = (_request(opening + text * 20, 4) for text in ("alpha ", "bravo ", "charlie "))
    reply = [t for t in greedy_reference(a.prompt, 4) if t not in FakeTokenizer.eos_token_ids]
    again = GenerationRequest(a.prompt + reply + FakeTokenizer().encode(" and then?"), _greedy(4))

    async def main() -> Finished:
        for request in (a, b, c):
            await _run(scheduler.submit(request))
        return (await _run(scheduler.submit(again)))[2]

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    held = len(a.prompt) + len(reply)  # all of A (the last reply token fed the window after it)
    block = engine.kv_pools.block
    assert end.timings.cache_n == (held // block * block if shares else held)
    assert len(scheduler.cache) == (0 if shares else 2)  # B and C (A went back into the slot)


class _NoEos(FakeEngine):
    """Never samples an end-of-sequence token, so a stream runs until its max_tokens or a cancel."""

    def prefill(self, session, token_ids):  # type: ignore[no-untyped-def]
        return self._no_eos(super().prefill(session, token_ids))

    def decode_window(self, steps, fed=None):  # type: ignore[no-untyped-def]
        return self._no_eos(super().decode_window(steps, fed))

    def _no_eos(self, logits: torch.Tensor) -> torch.Tensor:
        logits[..., sorted(FakeTokenizer.eos_token_ids)] = -math.inf
        return logits


async def _first_delta(handle: RequestHandle) -> None:
    assert isinstance(await handle.events.get(), Delta)


async def _cancelled(handle: RequestHandle) -> None:
    handle.cancel()
    with pytest.raises(RequestCancelled):
        async for _ in handle:
            pass


def test_long_prompts_arriving_while_streams_decode_do_not_stop_them() -> None:
    """Two long prompts arrive while two streams decode: every step keeps both streams' rows and its
    prompt chunks within --step-tokens, and the first prompt's chunks all run before the second's."""
    engine = _NoEos(max_context=8192)
    budget = 64
    scheduler = _scheduler(engine, parallel=4, step_tokens=budget)
    long = [GenerationRequest([3 + (i + k) % 200 for k in range(1000)], _greedy(2)) for i in range(2)]

    async def main() -> None:
        streams = [scheduler.submit(_request(f"stream {i}", max_tokens=5000)) for i in range(2)]
        for handle in streams:
            await _first_delta(handle)  # both decode now
        ends = await asyncio.gather(*(_run(scheduler.submit(r)) for r in long))
        assert [end.completion_tokens for _, _, end in ends] == [2, 2]
        for handle in streams:
            await _cancelled(handle)

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    chunks = [[i for i, (kind, s, _) in enumerate(engine.calls) if kind == "prefill" and s.tokens[:1000] == r.prompt]
              for r in long]
    first, last = chunks[0][0], chunks[1][-1]
    assert max(chunks[0]) < min(chunks[1])  # oldest first
    during = steps_of(engine.calls[first : last + 1])
    assert len(during) >= 2 * 1000 // budget  # windows between the prompts' first and last chunks
    assert all(rows >= 2 for rows, _ in during)
    assert all(rows + prompt <= budget for rows, prompt in steps_of(engine.calls))


def test_a_request_cancelled_in_its_prefill_frees_its_slot_and_session() -> None:
    entered, gate = threading.Event(), threading.Event()
    sessions = []

    class Gated(FakeEngine):
        def prefill(self, session, token_ids):  # type: ignore[no-untyped-def]
            if len(session.tokens) + len(token_ids) > 100 and not entered.is_set():
                sessions.append(session)
                entered.set()
                gate.wait(10)
            return super().prefill(session, token_ids)

    engine = Gated(max_context=4096)
    engine.settings = StrataSettings(prefill_chunk=32)  # the idle step's chunk: the prompt takes 16
    scheduler = _scheduler(engine, parallel=1, max_queue=1, step_tokens=8)
    long = GenerationRequest([3 + k % 200 for k in range(500)], _greedy(4))

    async def main() -> Finished:
        handle = scheduler.submit(long)
        assert await asyncio.to_thread(entered.wait, 10)  # in the middle of the prompt
        handle.cancel()
        gate.set()
        with pytest.raises(RequestCancelled):
            await _run(handle)
        return (await asyncio.wait_for(_run(scheduler.submit(_request("next", 4))), 10))[2]

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    (session,) = sessions
    assert end.completion_tokens >= 1 and scheduler.stats.cancelled == 1
    assert session.released  # at once, not kept for prefix reuse
    assert [n for kind, s, n in engine.calls if s is session] == [32] * 4  # no chunk after the cancel


class _FailsMidPrompt(FakeEngine):
    """A prompt that starts with token 7 fails in its second chunk."""

    def prefill(self, session, token_ids):  # type: ignore[no-untyped-def]
        if session.tokens[:1] == [7]:
            raise RuntimeError("device fault in a later chunk")
        return super().prefill(session, token_ids)


def test_a_request_whose_prefill_chunk_fails_ends_alone() -> None:
    engine = _FailsMidPrompt(max_context=4096)
    engine.settings = StrataSettings(prefill_chunk=16)  # idle steps chunk the prompts too
    scheduler = _scheduler(engine, parallel=2, step_tokens=16)
    good = [_request(f"good request number {i} " * 3, 12) for i in range(3)]
    bad = GenerationRequest([7] + [50] * 200, _greedy(4))

    async def main() -> list:
        handles = [scheduler.submit(good[0]), scheduler.submit(bad), scheduler.submit(good[1]),
                   scheduler.submit(good[2])]
        return await asyncio.gather(*(_run(h) for h in handles), return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert isinstance(results[1], RuntimeError) and "later chunk" in str(results[1])
    for request, (tokens, _, _) in zip(good, [results[0], results[2], results[3]]):
        assert tokens == [t for t in _tokens_alone(request) if t not in FakeTokenizer.eos_token_ids]
    bad_sessions = {id(s) for kind, s, _ in engine.calls if s is not None and s.tokens[:1] == [7]}
    assert bad_sessions and not bad_sessions & engine.live  # its session was released
    assert scheduler.stats.failed == 1 and scheduler.stats.requests == 3


def test_requests_submitted_together_all_start_in_the_first_step() -> None:
    engine = FakeEngine()
    scheduler = Scheduler(engine, parallel=4, max_queue=4, conv_cache=0, conv_cache_bytes=0, step_tokens=16)
    requests = [_request(f"together {i}", 5) for i in range(4)]

    async def main() -> list[tuple[list[int], str, Finished]]:
        handles = [scheduler.submit(r) for r in requests]  # all queued before the worker looks
        scheduler.start()
        return await asyncio.gather(*(_run(h) for h in handles))

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert [kind for kind, _, _ in engine.calls[:5]] == ["prefill"] * 4 + ["window"]
    assert engine.windows[0] == 4  # every request had its first token in step one
    for request, (tokens, _, _) in zip(requests, results):
        assert tokens == [t for t in _tokens_alone(request) if t not in FakeTokenizer.eos_token_ids]


def test_an_idle_step_runs_prompt_chunks_of_the_engine_s_size() -> None:
    """With no stream decoding nobody waits on a step: a prompt goes in --prefill-chunk pieces, and in
    --step-tokens pieces (less the decode rows) once a stream decodes."""
    engine = _NoEos(max_context=4096)
    engine.settings = StrataSettings(prefill_chunk=100)
    scheduler = _scheduler(engine, parallel=2, step_tokens=20)
    prompt = [3 + k % 200 for k in range(250)]

    async def main() -> None:
        await _run(scheduler.submit(GenerationRequest(prompt, _greedy(1))))
        stream = scheduler.submit(_request("a stream", max_tokens=5000))
        await _first_delta(stream)
        await _run(scheduler.submit(GenerationRequest(prompt[::-1], _greedy(1))))
        await _cancelled(stream)

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    lengths = [n for kind, s, n in engine.calls if kind == "prefill" and len(s.tokens) >= 250]
    assert lengths[:3] == [100, 100, 50]
    assert lengths[3:] == [19] * 13 + [3]


def test_a_window_hands_its_events_to_the_event_loop_in_one_call(monkeypatch) -> None:
    """Each call onto the event loop wakes it through its self-pipe and competes for the GIL: the
    events of a window's rows go over together, one call per window, not one per row."""
    from strata_core.serving import scheduler as scheduler_module

    handed: list[int] = []  # events per call
    deliver = scheduler_module._deliver

    def counted(events):
        handed.append(len(events))
        deliver(events)

    monkeypatch.setattr(scheduler_module, "_deliver", counted)
    engine = FakeEngine(step_delay=0.001)
    scheduler = _scheduler(engine, parallel=4)
    requests = [_request(f"prompt {i}", max_tokens=12) for i in range(4)]

    async def main() -> list[tuple[list[int], str, Finished]]:
        return await asyncio.gather(*(_run(scheduler.submit(r)) for r in requests))

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert all(end.completion_tokens for _, _, end in results)
    assert len(handed) <= len(engine.windows) + len(engine.batches)  # at most one call per engine call
    assert max(handed) >= 2 and max(engine.windows) == 4  # a window of several rows: one call for them


class _Recorded(FakeEngine):
    """The fake engine keeping every session it made."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.0005, max_context=96)
        self.sessions: list = []

    def new_session(self, prefix_tokens=()):  # type: ignore[no-untyped-def]
        session = super().new_session(prefix_tokens)
        self.sessions.append(session)
        return session


def test_overlapped_windows_give_what_windows_one_at_a_time_give() -> None:
    """Overlapped (each window fed its tokens on the "device") and one at a time, the same requests give
    the same tokens, text and endings: greedy and seeded draws, penalties, log-probabilities, stop
    strings, max_tokens, the end of the context, more requests than slots; every position a window was
    fed is settled with the token it was fed (FakeSession.settle checks it), none left unsettled."""
    def params(i: int) -> SamplingParams:
        return [SamplingParams(temperature=0, max_tokens=5 + i),
                SamplingParams(temperature=0.8, seed=i, max_tokens=40, repetition_penalty=1.3),
                SamplingParams(temperature=1.0, seed=i, top_k=5, logprobs=2, max_tokens=12),
                SamplingParams(temperature=0, stop=("e",), max_tokens=30),
                SamplingParams(temperature=0, max_tokens=None)][i % 5]

    requests = [GenerationRequest(FakeTokenizer().encode(f"request {i} " * (1 + i % 3)), params(i)) for i in range(11)]
    runs = {}
    for overlap in (False, True):
        engine = _Recorded()
        scheduler = Scheduler(engine, parallel=3, max_queue=16, conv_cache=2, conv_cache_bytes=1 << 20,
                              step_tokens=24, overlap=overlap)
        scheduler.start()

        async def main() -> list:
            return await asyncio.gather(*(_run(scheduler.submit(r)) for r in requests))

        try:
            out = asyncio.run(main())
        finally:
            scheduler.stop()
        runs[overlap] = [(tokens, text, end.reason, end.completion_tokens) for tokens, text, end in out]
        assert all(not s.unsettled for s in engine.sessions)
    assert runs[True] == runs[False]
    assert {reason for _, _, reason, _ in runs[True]} >= {"length", "stop"}
