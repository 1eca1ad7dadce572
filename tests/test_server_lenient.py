"""What agents and their clients send and expect, as llama-server answers it: unknown fields, any model
name, stream chunk shapes, the context error's token counts, the server's default max_tokens."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_support import N_SPECIAL, FakeEngine, live_server

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


def test_first_chat_chunk_is_the_role_with_content_null(url: str, client: openai.OpenAI) -> None:
    """As llama-server sends it: never content "" (some clients print it), and the key there (its tests read it)."""
    events = _events(url, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 3, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
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
    assert error["type"] == "exceed_context_size_error"  # llama-server's
    assert (error["n_prompt_tokens"], error["n_ctx"]) == (n_prompt, 128)


@pytest.fixture(scope="module")
def strict_url() -> Iterator[str]:
    settings = StrataSettings(model_alias=MODEL, parallel=1, strict_requests=True, strict_model=True)
    with live_server(settings, FakeEngine(max_context=128)) as base:
        yield base


def _info(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.getMessage().startswith(start)]


def test_unknown_fields_are_accepted_and_each_name_logged_once(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata_core.serving.server.service")
    chat = {"model": MODEL, "messages": HI, "max_tokens": 2, "cache_control": {"type": "x"}, "n_probs": 0}
    for _ in range(2):
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 200
    text = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n_probs": 0, "mirostat": 0}
    assert httpx.post(f"{url}/v1/completions", json=text).status_code == 200
    assert _info(caplog, "ignoring unknown") == ["ignoring unknown request fields: cache_control, n_probs",
                                                 "ignoring unknown request fields: mirostat"]


def test_strict_requests_refuses_an_unknown_field_naming_it(strict_url: str) -> None:
    payload = {"model": MODEL, "messages": HI, "max_tokens": 2, "cache_control": 1, "n_probs": 0}
    error = httpx.post(f"{strict_url}/v1/chat/completions", json=payload).json()["error"]
    assert error["param"] == "cache_control" and error["code"] == "invalid_request"
    assert "unknown field `cache_control`" in error["message"] and "n_probs" in error["message"]
    response = httpx.post(f"{strict_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "bogus": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bogus"
    known = {"model": MODEL, "messages": HI, "max_tokens": 2, "store": False, "user": "u"}  # declared, ignored
    assert httpx.post(f"{strict_url}/v1/chat/completions", json=known).status_code == 200


def test_any_model_name_or_none_is_served(url: str, client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata_core.serving.server.service")
    for name in ("gpt-4o", "gpt-4o", "local"):
        out = client.chat.completions.create(model=name, messages=HI, max_tokens=2)
        assert out.model == MODEL
    unnamed = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL
    assert _info(caplog, "serving ") == [f"serving {MODEL} for requests naming gpt-4o",
                                         f"serving {MODEL} for requests naming local"]


def test_strict_model_answers_404_for_another_name(strict_url: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": HI})):
        response = httpx.post(f"{strict_url}{path}", json={"model": "gpt-9", **body})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
    assert httpx.get(f"{strict_url}/v1/models/gpt-9").status_code == 404
    for name in (MODEL, None):  # the alias, or no name
        payload = {"prompt": "x", "max_tokens": 1, **({"model": name} if name else {})}
        assert httpx.post(f"{strict_url}/v1/completions", json=payload).status_code == 200


@pytest.mark.parametrize(("n_predict", "chat", "text"), [(-1, None, 16), (5, 5, 5)])
def test_n_predict_is_the_default_max_tokens(n_predict: int, chat: int | None, text: int) -> None:
    q = {"logit_bias": {str(N_SPECIAL + ord("Q")): 100}}  # never an end token: runs to the limit
    with live_server(StrataSettings(model_alias=MODEL, parallel=1, n_predict=n_predict), FakeEngine(64)) as base:
        reply = httpx.post(f"{base}/v1/chat/completions", json={"messages": HI, **q}).json()
        generated = reply["usage"]["completion_tokens"]
        assert (generated == chat) if chat else (generated >= 64 - reply["usage"]["prompt_tokens"])  # context full
        completion = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", **q}).json()
        assert completion["usage"]["completion_tokens"] == text
        given = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 3, **q}).json()
        assert given["usage"]["completion_tokens"] == 3
