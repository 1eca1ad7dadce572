"""Faults one client can cause must not hurt the server or the other clients (fake engine, live server)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import httpx
import pytest
import torch
from test_server_support import FakeEngine, FakeTokenizer, serving

from strata_core.config import StrataSettings
from strata_core.serving.requests import Finished, GenerationRequest, RequestCancelled
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler
from strata_core.serving.server.responses import collect
from strata_core.serving.stop_strings import MAX_STOP_CHARS

MODEL = "demo"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def _ok(url: str, prompt: str = "fine") -> None:
    out = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=10)
    assert out.status_code == 200, out.text


def _wait_until(condition, what: str, timeout: float = 10.0) -> None:
    """Wait for a condition another thread makes true (fails the test after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def url() -> str:
    with serving(StrataSettings(model_alias=MODEL, parallel=2, max_queue=1), FakeEngine()) as (base, _):
        yield base


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"repetition_penalty": 1e-300, "temperature": 1}, "repetition_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ({"n": 10**30}, "n"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 1e9}}, "logit_bias"),
    ],
)
def test_bad_values_are_400_and_leak_no_slot(url: str, extra: dict, param: str) -> None:
    for _ in range(4):  # more than parallel + max_queue: a leaked slot would make the last ones 503
        body = _error(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", **extra}), 400)
        assert param in (body["param"] or ""), body
    _ok(url)
    assert httpx.get(f"{url}/health").json()["slots_idle"] == 2


def test_json_nested_too_deep_is_400(url: str) -> None:
    deep = b'{"model": "demo", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    body = _error(httpx.post(f"{url}/v1/completions", content=deep, headers={"content-type": "application/json"}), 400)
    assert "nested" in body["message"]
    _ok(url)


def test_streams_are_server_sent_events(url: str) -> None:
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]


def test_busy_is_503_with_retry_after() -> None:
    entered, gate = threading.Event(), threading.Event()

    class Gated(FakeEngine):
        def prefill(self, session, token_ids):  # type: ignore[no-untyped-def]
            entered.set()
            gate.wait(10)
            return super().prefill(session, token_ids)

    with serving(StrataSettings(model_alias=MODEL, parallel=1, max_queue=0), Gated()) as (url, _):
        holder = threading.Thread(target=_ok, args=(url,))
        holder.start()
        try:
            assert entered.wait(10)  # the one slot is taken
            refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "me too"})
            assert _error(refused, 503)["code"] == "server_busy"
            assert refused.headers["retry-after"] == "1"
        finally:
            gate.set()
            holder.join()


def test_body_over_the_limit_is_413() -> None:
    with serving(StrataSettings(model_alias=MODEL, max_body_mib=0.01), FakeEngine()) as (url, _):
        body = _error(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * 20_000}), 413)
        assert body["type"] == "invalid_request_error"
        _ok(url)


class _BlockingTokenizer(FakeTokenizer):
    """Encoding text that contains BLOCK waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(10)
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_tokenizing_does_not_stall_the_event_loop(route: str) -> None:
    engine = FakeEngine()
    engine.tokenizer = tokenizer = _BlockingTokenizer()
    payload = ({"prompt": "BLOCK"} if route == "completions" else {"messages": [{"role": "user", "content": "BLOCK"}]})
    with serving(StrataSettings(model_alias=MODEL), engine) as (url, _):
        slow = threading.Thread(target=lambda: httpx.post(f"{url}/v1/{route}", json={"model": MODEL, "max_tokens": 1,
                                                                                       **payload}, timeout=20))
        slow.start()
        try:
            assert tokenizer.entered.wait(10)
            # the tokenizer is blocked: the loop still answers (on the loop this would time out)
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        finally:
            tokenizer.release.set()
            slow.join()


class _Endless(FakeEngine):
    """Never samples an end token; ``generating`` is set at the first decode window."""

    def __init__(self) -> None:
        super().__init__(max_context=100_000)
        self.generating = threading.Event()

    def prefill(self, session, token_ids):  # type: ignore[no-untyped-def]
        return self._no_eos(super().prefill(session, token_ids))

    def decode_window(self, steps, fed=None):  # type: ignore[no-untyped-def]
        self.generating.set()
        return self._no_eos(super().decode_window(steps, fed))

    def _no_eos(self, logits: torch.Tensor) -> torch.Tensor:
        logits[..., sorted(self.tokenizer.eos_token_ids)] = -math.inf
        return logits


def test_a_cancelled_non_streamed_request_ends_its_handler() -> None:
    engine = _Endless()
    with serving(StrataSettings(model_alias=MODEL, parallel=1), engine) as (url, server):
        body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 90_000}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert engine.generating.wait(10)  # hang up while the request generates
        _wait_until(lambda: not server.server_state.tasks, "the handler task to end")
        _ok(url)


def test_a_cancelled_request_ends_its_event_stream() -> None:
    engine = FakeEngine(max_context=100_000)
    scheduler = Scheduler(engine, parallel=1, max_queue=0, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=512)
    scheduler.start()

    async def main() -> None:
        handle = scheduler.submit(GenerationRequest([5, 6], SamplingParams(temperature=0, max_tokens=90_000)))
        handle.cancel()
        with pytest.raises(RequestCancelled):
            await asyncio.wait_for(collect(handle), 10)

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    assert scheduler.stats.cancelled == 1


class _NanForMarkedSessions(FakeEngine):
    """Decode logits are NaN for sessions whose prompt starts with token 7."""

    def decode_window(self, steps, fed=None):  # type: ignore[no-untyped-def]
        logits = super().decode_window(steps, fed)
        for row, (session, _) in enumerate(steps):
            if session.tokens[0] == 7:
                logits[row] = float("nan")
        return logits


def test_one_request_failing_to_sample_ends_only_that_request() -> None:
    engine = _NanForMarkedSessions(step_delay=0.001)
    scheduler = Scheduler(engine, parallel=2, max_queue=2, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=512)
    scheduler.start()
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=6)
    healthy = GenerationRequest([8, 9, 10], SamplingParams(temperature=0, max_tokens=40, stop=["\u2603"]))

    async def run(request: GenerationRequest):  # type: ignore[no-untyped-def]
        try:
            return (await collect(scheduler.submit(request))).end
        except Exception as exc:  # noqa: BLE001
            return exc

    async def main():  # type: ignore[no-untyped-def]
        return await asyncio.gather(run(healthy), run(GenerationRequest([7, 8], sampled)))

    try:
        good, bad = asyncio.run(main())
    finally:
        scheduler.stop()
    assert isinstance(bad, FloatingPointError) and "cannot sample" in str(bad)
    assert isinstance(good, Finished) and good.completion_tokens >= 1
    assert max(engine.windows) == 2  # they did share a decode window


def test_submit_that_fails_before_queueing_leaks_no_slot() -> None:
    engine = FakeEngine()
    broken = {"n": 0}
    orig = engine.tokenizer.stream_decoder

    def stream_decoder(skip_special_tokens=True):  # type: ignore[no-untyped-def]
        broken["n"] += 1
        if broken["n"] <= 3:
            raise RuntimeError("no decoder")
        return orig(skip_special_tokens)

    engine.tokenizer.stream_decoder = stream_decoder
    scheduler = Scheduler(engine, parallel=1, max_queue=0, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=512)
    scheduler.start()

    async def main() -> Finished:
        for _ in range(3):
            with pytest.raises(RuntimeError):
                scheduler.submit(GenerationRequest([5], SamplingParams(temperature=0, max_tokens=2)))
        return (await collect(scheduler.submit(GenerationRequest([5], SamplingParams(temperature=0, max_tokens=2))))).end

    try:
        end = asyncio.run(main())
    finally:
        scheduler.stop()
    assert isinstance(end, Finished)


def test_tiny_temperature_samples_the_top_token() -> None:
    from strata_core.serving.sampling import Sampler

    logits = torch.tensor([1.0, 3.0, 2.0])
    assert Sampler(SamplingParams(temperature=1e-300, seed=0)).sample(logits) == 1
