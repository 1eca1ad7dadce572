"""The HTTP API against a live uvicorn server on the fake engine: openai client, raw HTTP errors, auth."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_support import FakeEngine, FakeTokenizer, greedy_reference, live_server

from strata_core.config import StrataSettings

MODEL = "demo"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_context=128)


@pytest.fixture(scope="module")
def base_url(engine: FakeEngine) -> Iterator[str]:
    settings = StrataSettings(model_alias=MODEL, parallel=2, max_queue=4, conv_cache=2)
    with live_server(settings, engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _expected_text(prompt: list[int], max_tokens: int) -> str:
    tokens = greedy_reference(prompt, max_tokens)
    return FakeTokenizer().decode(tokens)


def _chat_prompt(text: str) -> list[int]:
    return FakeTokenizer().encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content == _expected_text(_chat_prompt("hello"), 8)
    assert out.choices[0].finish_reason in {"length", "stop"}
    assert out.usage.prompt_tokens == len(_chat_prompt("hello"))
    assert out.usage.completion_tokens == out.model_extra["timings"]["predicted_n"] <= 8
    timings = out.model_extra["timings"]
    assert set(timings) == {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                            "predicted_per_second", "cache_n", "experts"}
    assert set(timings["experts"]) == {"prompt", "decode"}
    assert set(timings["experts"]["prompt"]) == {"hit_rate", "bytes_streamed", "link_gbps", "copy_ms", "compute_ms"}
    assert timings["prompt_n"] + timings["cache_n"] == out.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "stream me"}]}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _expected_text(_chat_prompt("stream me"), 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"length", "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(_chat_prompt("stream me"))


def test_completion_and_stop(client: openai.OpenAI) -> None:
    prompt = "once upon"
    full = _expected_text(FakeTokenizer().encode(prompt), 16)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == full
    stop = full[5:7]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                         stop=stop)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]


def test_completion_logprobs_and_token_prompt(client: openai.OpenAI) -> None:
    ids = FakeTokenizer().encode("abc")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top token


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="seed", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_metrics_openapi(base_url: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="m", max_tokens=2)
    assert httpx.get(f"{base_url}/health").json()["status"] == "ok"
    text = httpx.get(f"{base_url}/metrics").text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(values["strata_requests_total"]) >= 1
    assert float(values["strata_completion_tokens_total"]) >= 2
    assert float(values["strata_expert_cache_hit_ratio"]) == 0.75
    assert float(values["strata_bytes_streamed_total"]) == 42
    assert "strata_requests_queued" in values
    schema = httpx.get(f"{base_url}/schema/openapi.json").json()
    ops = {op["operationId"] for path in schema["paths"].values() for op in path.values()}
    assert {"createChatCompletion", "createCompletion", "listModels", "health", "metrics"} <= ops


def _error(response: httpx.Response, status: int, extra: tuple[str, ...] = ()) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code", *extra}
    return body


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens", "int"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens",
         "context"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}, "temperature", "<= 2"),
        ({"model": MODEL, "messages": []}, "messages", "length"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "robot"),
        ({"model": MODEL}, "messages", "missing"),
    ],
)
def test_bad_requests_are_400(base_url: str, payload: dict, param: str, words: str) -> None:
    body = _error(httpx.post(f"{base_url}/v1/chat/completions", json=payload), 400)
    assert param in (body["param"] or "") and words in body["message"], body


def test_malformed_json_long_prompt(base_url: str) -> None:
    body = _error(httpx.post(f"{base_url}/v1/completions", content=b"{not json",
                             headers={"content-type": "application/json"}), 400)
    assert "JSON" in body["message"] or "json" in body["message"]
    body = _error(httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x" * 500}), 400,
                  ("n_prompt_tokens", "n_ctx"))
    assert body["code"] == "context_length_exceeded" and "500 tokens" in body["message"]
    body = _error(httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": [10**6]}), 400)
    assert body["param"] == "prompt"


def test_failing_request_does_not_disturb_others(base_url: str, client: openai.OpenAI) -> None:
    body = _error(httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "boom \u2620"}), 500)
    assert "poisoned" in body["message"]
    out = client.completions.create(model=MODEL, prompt="after", max_tokens=4, temperature=0)
    assert out.choices[0].text == _expected_text(FakeTokenizer().encode("after"), 4)


def test_stream_error_after_start_is_an_event(base_url: str) -> None:
    payload = {"model": MODEL, "prompt": "boom \u2620", "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=payload) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["error"]["message"].endswith("poisoned prompt")
    assert events[-1] == "data: [DONE]"


def test_api_key() -> None:
    settings = StrataSettings(model_alias=MODEL, api_key="sesame", parallel=1)
    with live_server(settings, FakeEngine()) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/schema/openapi.json"):
            _error(httpx.get(f"{url}{path}"), 401)
            _error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong"}), 401)
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
