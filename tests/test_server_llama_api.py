"""llama-server's own API as its clients use it: routes without /v1, /completion, /apply-template,
token pieces, X-Api-Key, /props' defaults and CORS."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_server_support import FakeChat, FakeEngine, FakeTokenizer, live_server

from strata_core.config import StrataSettings

MODEL = "demo"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=2), FakeEngine(max_context=128)) as base:
        yield base


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                            ("/completions", {"prompt": "hi"})])
def test_openai_routes_answer_without_v1(url: str, path: str, body: dict) -> None:
    root, v1 = (httpx.post(f"{url}{prefix}{path}", json={**body, "max_tokens": 6, "temperature": 0}).json()
                for prefix in ("", "/v1"))
    assert root["object"] == v1["object"]
    assert root["choices"][0] == v1["choices"][0] and root["usage"]["completion_tokens"] == 6


def test_models_answer_without_v1(url: str) -> None:
    assert httpx.get(f"{url}/models").json() == httpx.get(f"{url}/v1/models").json()
    assert httpx.get(f"{url}/models/{MODEL}").json()["id"] == MODEL


def test_x_api_key_is_an_alternative_to_bearer() -> None:
    with live_server(StrataSettings(model_alias=MODEL, api_key="sesame"), FakeEngine()) as base:
        assert httpx.get(f"{base}/props", headers={"X-Api-Key": "sesame"}).status_code == 200
        assert httpx.get(f"{base}/props", headers={"Authorization": "Bearer sesame"}).status_code == 200
        for headers in ({"X-Api-Key": "wrong"}, {"X-Api-Key": "Bearer sesame"}, {}):
            denied = httpx.get(f"{base}/v1/models", headers=headers)
            assert denied.status_code == 401 and "X-Api-Key" in denied.json()["error"]["message"]


def test_tokenize_with_pieces_gives_each_token_its_text(url: str) -> None:
    text = "<|im_start|>héllo wörld"
    ids = httpx.post(f"{url}/tokenize", json={"content": text}).json()["tokens"]
    out = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in out] == ids == FakeTokenizer().encode(text)
    assert "".join(t["piece"] for t in out) == text
    assert [t["piece"] for t in out[:4]] == ["<|im_start|>", "h", "", "é"]  # é is two byte tokens
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"content": "héllo wörld"}


def test_apply_template_gives_the_chat_prompt(url: str) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    out = httpx.post(f"{url}/apply-template", json={"messages": messages})
    assert out.status_code == 200
    prompt = out.json()["prompt"]
    assert prompt == FakeChat().render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    # the chat endpoint generates from exactly that prompt
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0})
    completion = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
    assert httpx.post(f"{url}/apply-template", json={"messages": []}).status_code == 400
