"""What OpenAI and llama-server clients send and call: extra fields, /tokenize, /props, /slots, the request log."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_support import N_SPECIAL, FakeEngine, FakeTokenizer, live_server

from strata_core.config import StrataSettings

MODEL = "demo"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=2), FakeEngine(max_context=128)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_logit_bias_steers_the_tokens(client: openai.OpenAI) -> None:
    q = N_SPECIAL + ord("Q")
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0, logit_bias={str(q): 100})
    assert out.choices[0].text == "QQQQQ"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(q): 100}, user="someone")
    assert chat.choices[0].message.content == "QQQ"


def test_n_predict_and_cache_prompt(url: str) -> None:
    out = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "abc", "n_predict": 3, "temperature": 0,
                                                    "cache_prompt": True}).json()
    assert out["usage"]["completion_tokens"] <= 3
    default = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "zzz", "temperature": 0,
                                                        "logit_bias": {str(N_SPECIAL + ord("Q")): 100}}).json()
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_ignore_eos_generates_max_tokens_past_an_end_token(url: str) -> None:
    payload = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, "logit_bias": {"0": 100}}
    ended = httpx.post(f"{url}/v1/completions", json=payload).json()
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    ran = httpx.post(f"{url}/v1/completions", json={**payload, "ignore_eos": True}).json()
    assert ran["usage"]["completion_tokens"] == 6 and ran["choices"][0]["finish_reason"] == "length"


def test_harmless_fields_are_ignored_with_one_log_line(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata_core.serving.server.service")
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": False,
               "metadata": {"a": "b"}, "parallel_tool_calls": False, "service_tier": "auto"}
    assert httpx.post(f"{url}/v1/chat/completions", json=payload).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert lines == ["ignoring fields Strata does not implement: store, metadata, service_tier"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_fields_whose_omission_would_change_the_answer_are_400(url: str, extra: dict, param: str) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
    assert param in response.json()["error"]["message"]


@pytest.mark.parametrize(("extra", "param"), [({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"),
                                              ({"best_of": 3}, "best_of")])
def test_completion_only_fields_not_implemented_are_400(url: str, extra: dict, param: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_tokenize_and_detokenize(url: str) -> None:
    tokens = httpx.post(f"{url}/tokenize", json={"content": "héllo"}).json()["tokens"]
    assert tokens == FakeTokenizer().encode("héllo")
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json() == {"content": "héllo"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_props_and_slots(url: str, client: openai.OpenAI) -> None:
    props = httpx.get(f"{url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 128
    assert props["default_generation_settings"]["model"] == props["model_alias"] == MODEL
    assert props["total_slots"] == 2 and props["chat_template"]
    client.completions.create(model=MODEL, prompt="fill a slot", max_tokens=2, temperature=0)
    slots = httpx.get(f"{url}/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    assert not any(s["is_processing"] for s in slots)
    assert max(s["n_tokens"] for s in slots) >= len("fill a slot")  # the idle session kept for reuse


def test_one_log_line_per_request(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata_core.serving.scheduler")
    client.completions.create(model=MODEL, prompt="log me", max_tokens=3, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request done")]
    assert len(lines) == 1
    assert "prompt 6 tokens" in lines[0] and "generated" in lines[0] and "tok/s" in lines[0]
    assert "hit rate" in lines[0] and "finish " in lines[0]
