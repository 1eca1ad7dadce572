"""What agents and their clients send and expect, as llama-server answers it: unknown fields, any model
name, stream chunk shapes, the context error's token counts, the server's default max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_support import FakeEngine, live_server

from strata_core.config import StrataSettings
from strata_core.serving.server.schemas import SYSTEM_FINGERPRINT

MODEL = "demo"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=2), FakeEngine(max_context=128)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _events(url: str, path: str, payload: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=payload) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_first_chat_chunk_is_the_role_alone(url: str, client: openai.OpenAI) -> None:
    events = _events(url, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", {"messages": HI}),
                                            ("/v1/completions", {"prompt": "hi"})])
def test_usage_chunk_carries_timings_and_every_object_a_fingerprint(url: str, path: str, body: dict) -> None:
    payload = {"model": MODEL, **body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(url, path, payload)
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == last["timings"]["predicted_n"] >= 1
    assert {e["system_fingerprint"] for e in events} == {SYSTEM_FINGERPRINT}
    whole = httpx.post(f"{url}{path}", json={"model": MODEL, **body, "max_tokens": 3}).json()
    assert SYSTEM_FINGERPRINT.startswith("strata-") and whole["system_fingerprint"] == SYSTEM_FINGERPRINT


@pytest.mark.parametrize(
    ("path", "body", "n_prompt"),
    [("/v1/completions", {"prompt": "x" * 500}, 500),  # tokenized: the scheduler counts it
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, 154),  # refused untokenized
     ("/v1/chat/completions", {"messages": HI * 129}, 129)],  # a token per message at least
)
def test_context_error_reports_the_prompt_and_context_tokens(url: str, path: str, body: dict, n_prompt: int) -> None:
    response = httpx.post(f"{url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["message"]
    assert (error["n_prompt_tokens"], error["n_ctx"]) == (n_prompt, 128)
