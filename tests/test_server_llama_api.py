"""llama-server's own API as its clients use it: routes without /v1, /completion, /apply-template,
token pieces, X-Api-Key, /props' defaults and CORS."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from test_server_support import N_SPECIAL, FakeChat, FakeEngine, FakeTokenizer, greedy_reference, live_server

from strata_core.config import StrataSettings

MODEL = "demo"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=2), FakeEngine(max_context=128)) as base:
        yield base


def test_openai_routes_answer_without_v1(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    root, v1 = (httpx.post(f"{url}{prefix}/chat/completions", json=body).json() for prefix in ("", "/v1"))
    assert root["object"] == v1["object"] == "chat.completion"
    assert root["choices"][0] == v1["choices"][0] and root["usage"]["completion_tokens"] == 6


def test_completions_without_v1_is_llama_servers_native_completion(url: str) -> None:
    """As in llama-server: /completions is /completion; only /v1/completions is OpenAI's."""
    body = {"prompt": "hi", "n_predict": 6, "temperature": 0}
    native, plural = (httpx.post(f"{url}{path}", json=body).json() for path in ("/completion", "/completions"))
    assert native["content"] == plural["content"] and plural["tokens_predicted"] == 6
    openai = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 6}).json()
    assert openai["object"] == "text_completion" and openai["choices"][0]["text"] == native["content"]


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


def test_tokenize_with_pieces_gives_each_token_its_own_piece(url: str) -> None:
    """As llama-server: a token's piece is its text where its bytes are whole UTF-8, else their values."""
    text = "<|im_start|>héllo wörld"
    ids = httpx.post(f"{url}/tokenize", json={"content": text}).json()["tokens"]
    out = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in out] == ids == FakeTokenizer().encode(text)
    assert [t["piece"] for t in out[:5]] == ["<|im_start|>", "h", [0xC3], [0xA9], "l"]  # é is two byte tokens
    assert b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in (t["piece"] for t in out)) == text.encode()
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"content": "héllo wörld"}


def test_tokenize_takes_llama_servers_other_fields(url: str) -> None:
    out = httpx.post(f"{url}/tokenize", json={"content": "hi", "parse_special": True})
    assert out.status_code == 200 and out.json()["tokens"] == FakeTokenizer().encode("hi")
    assert httpx.post(f"{url}/detokenize", json={"tokens": out.json()["tokens"], "x": 1}).json() == {"content": "hi"}


def test_health_body_has_no_error_key_while_serving(url: str) -> None:
    """llama.cpp's clients take a body with an "error" key for a failure."""
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0,
                                                  "requests_queued": 0, "progress": 1.0}


def test_apply_template_takes_add_generation_prompt_and_continue_final_message(url: str) -> None:
    """vLLM's and llama-server's template arguments: no assistant header, or the final message continued."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Wh"}]
    closed = FakeChat().render(messages, add_generation_prompt=False)

    def render(**fields: object) -> httpx.Response:
        return httpx.post(f"{url}/apply-template", json={"messages": messages, **fields})

    assert render().json()["prompt"] == closed + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=False).json()["prompt"] == closed
    continued = render(add_generation_prompt=False, continue_final_message=True).json()["prompt"]
    assert continued == closed[: closed.rindex("Wh") + 2] and continued.endswith("<|im_start|>assistant\nWh")
    both = render(continue_final_message=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
        "continue_final_message": True})
    raw = httpx.post(f"{url}/v1/completions", json={"prompt": continued, "max_tokens": 3, "temperature": 0})
    assert chat.json()["choices"][0]["message"]["content"] == raw.json()["choices"][0]["text"]


def test_two_assistant_messages_at_the_end_are_a_400(url: str) -> None:
    """llama-server refuses a conversation ending with two assistant messages (which would the reply follow?);
    one at the end is rendered (closed, or continued with continue_final_message)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"}]
    for path in ("/v1/chat/completions", "/apply-template"):
        out = httpx.post(f"{url}{path}", json={"messages": messages, "max_tokens": 2})
        assert out.status_code == 400 and out.json()["error"]["param"] == "messages", path
        assert "two assistant messages" in out.json()["error"]["message"]
    assert httpx.post(f"{url}/apply-template", json={"messages": messages[:2]}).status_code == 200


# the ending of llama.cpp's DeepSeek-R1 template: an unset enable_thinking closes the think block
THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant><think>\n{% if not enable_thinking %}</think>{% endif %}"
                     "{% endif %}")


@pytest.mark.parametrize(("reasoning", "fields", "ending"), [
    ("auto", {}, "<think>\n"), ("on", {}, "<think>\n"), ("off", {}, "<think>\n</think>"),
    ("auto", {"reasoning_effort": "none"}, "<think>\n</think>"),
    ("off", {"chat_template_kwargs": {"enable_thinking": True}}, "<think>\n")])
def test_enable_thinking_is_passed_as_llama_server_passes_it(reasoning: str, fields: dict, ending: str) -> None:
    """True unless --reasoning off, for a template that reads it; a request's own choice wins."""
    from strata_core.text.chat import ChatTemplate

    engine = FakeEngine()
    engine.chat = ChatTemplate(THINKING_TEMPLATE)
    with live_server(StrataSettings(model_alias=MODEL, reasoning=reasoning), engine) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        assert httpx.post(f"{base}/apply-template", json=body).json()["prompt"] == "<user>hi<assistant>" + ending


def test_chat_input_tokens_counts_the_rendered_prompt(url: str) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    prompt = httpx.post(f"{url}/apply-template", json=body).json()["prompt"]
    for prefix in ("", "/v1"):
        out = httpx.post(f"{url}{prefix}/chat/completions/input_tokens", json=body)
        assert out.status_code == 200 and out.json() == {"input_tokens": len(FakeTokenizer().encode(prompt))}


def test_chat_stream_first_delta_is_the_role_with_content_null(url: str) -> None:
    """As llama-server sends it (its tests read delta["content"] of the first chunk, no delta has "", and
    only the finish and usage chunks have a "timings" key)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all("role" not in e["choices"][0]["delta"] and e["choices"][0]["delta"].get("content") != ""
               for e in events[1:] if e["choices"])
    assert events[-1]["choices"] == [] and "timings" in events[-1] and events[-1]["usage"]["completion_tokens"] == 4
    assert [i for i, e in enumerate(events) if "timings" in e] == [len(events) - 2, len(events) - 1]  # the finish


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


def test_completion_answers_as_v1_completions_does(url: str) -> None:
    native = httpx.post(f"{url}/completion", json={"prompt": "abc", "n_predict": 7, "temperature": 0}).json()
    openai_form = httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 7, "temperature": 0}).json()
    assert native["content"] == openai_form["choices"][0]["text"]
    assert native["stop"] is True and native["stop_type"] == "limit" and native["stopping_word"] == ""
    assert native["tokens_predicted"] == 7 and native["tokens_evaluated"] == 3 and native["truncated"] is False
    assert native["model"] == MODEL and native["timings"]["predicted_n"] == 7
    assert native["generation_settings"]["n_predict"] == 7 and native["generation_settings"]["temperature"] == 0
    assert "completion_probabilities" not in native
    ids = FakeTokenizer().encode("abc")
    assert httpx.post(f"{url}/completion", json={"prompt": ids, "n_predict": 7, "temperature": 0}).json()["content"] \
        == native["content"]


def test_completion_without_n_predict_runs_past_openais_16_tokens(url: str) -> None:
    out = httpx.post(f"{url}/completion", json={"prompt": "abc", "temperature": 0}).json()
    assert out["tokens_predicted"] > 16 and out["generation_settings"]["n_predict"] == -1


def test_completion_stop_types() -> None:
    engine = FakeEngine(max_context=128)
    greedy = FakeTokenizer().decode(greedy_reference(FakeTokenizer().encode("abc"), 12))
    engine.tokenizer.eos_token_ids = {N_SPECIAL + ord(greedy[6])}  # the greedy run's 7th character ends it
    with live_server(StrataSettings(model_alias=MODEL), engine) as base:
        body = {"prompt": "abc", "n_predict": 12, "temperature": 0}
        eos = httpx.post(f"{base}/completion", json=body).json()
        assert eos["stop_type"] == "eos" and eos["stopping_word"] == ""
        assert eos["content"] == greedy[: greedy.index(greedy[6])]
        word = greedy[1:3]
        stopped = httpx.post(f"{base}/completion", json={**body, "stop": ["zzzz", word]}).json()
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
        assert stopped["content"] == greedy[: greedy.index(word)]
        assert stopped["generation_settings"]["stop"] == ["zzzz", word]


def test_completion_stream_ends_with_stop_and_timings(url: str) -> None:
    body = {"prompt": "abc", "n_predict": 6, "temperature": 0}
    whole = httpx.post(f"{url}/completion", json=body).json()
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    *chunks, last = events
    assert all(c["stop"] is False for c in chunks) and "".join(c["content"] for c in chunks) == whole["content"]
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["timings"]["predicted_n"] == 6 and last["tokens_predicted"] == 6


def test_completion_logit_bias_in_llama_servers_forms(url: str) -> None:
    """/completion's logit_bias as llama-server reads it: pairs or an object, tokens by id or text, false bans."""
    body = {"prompt": "abc", "n_predict": 1, "temperature": 0, "n_probs": 1}
    first = httpx.post(f"{url}/completion", json=body).json()["completion_probabilities"][0]
    token, text = first["id"], first["token"]
    assert FakeTokenizer().encode(text) == [token]
    for bias in ([[token, False]], [[text, -100]], {str(token): -100.0}, {text: False}, [[text, -50], ["x"]]):
        out = httpx.post(f"{url}/completion", json={**body, "logit_bias": bias})
        assert out.status_code == 200 and out.json()["completion_probabilities"][0]["id"] != token, bias
    same = httpx.post(f"{url}/completion", json={**body, "logit_bias": [[token, "x"], [True, -100]]}).json()
    assert same["completion_probabilities"][0]["id"] == token  # entries of other shapes are skipped
    assert same["generation_settings"]["logit_bias"] == []
    banned = httpx.post(f"{url}/completion", json={**body, "logit_bias": {text: False}}).json()
    assert banned["generation_settings"]["logit_bias"] == [{"bias": -100.0, "token": token}]


def test_completion_n_probs(url: str) -> None:
    body = {"prompt": "abc", "n_predict": 4, "temperature": 0, "n_probs": 3}
    out = httpx.post(f"{url}/completion", json=body).json()
    probs = out["completion_probabilities"]
    assert len(probs) == 4 and "".join(p["token"] for p in probs) == out["content"]
    assert all(len(p["top_logprobs"]) == 3 and p["id"] == p["top_logprobs"][0]["id"] for p in probs)  # greedy
    openai_form = httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0,
                                                            "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert [p["logprob"] for p in probs] == pytest.approx(openai_form["token_logprobs"])
    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")][:-1]
    assert [p for c in chunks for p in c["completion_probabilities"]] == probs


@pytest.mark.parametrize(("field", "value"), [("n_probs", 21), ("n_predict", -2), ("prompt", []), ("top_p", 0)])
def test_completion_rejects_bad_values_naming_the_field(url: str, field: str, value: object) -> None:
    response = httpx.post(f"{url}/completion", json={"prompt": "abc", field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_props_report_the_sampling_defaults_a_request_gets(url: str) -> None:
    props = httpx.get(f"{url}/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 128 and props["total_slots"] == 2 and props["model_alias"] == MODEL
    assert props["model_path"].endswith(".gguf")
    params = settings["params"]
    assert params["n_predict"] == -1 and params["temperature"] == 1.0 and params["top_k"] == 0
    assert params["seed"] is None and params["stop"] == []
    plain = httpx.post(f"{url}/completion", json={"prompt": "abc"}).json()
    assert plain["generation_settings"] == params


def test_props_and_completion_follow_the_server_n_predict() -> None:
    with live_server(StrataSettings(model_alias=MODEL, n_predict=5), FakeEngine()) as base:
        assert httpx.get(f"{base}/props").json()["default_generation_settings"]["params"]["n_predict"] == 5
        out = httpx.post(f"{base}/completion", json={"prompt": "abc", "temperature": 0}).json()
        assert out["tokens_predicted"] == 5 and out["stop_type"] == "limit"
        assert out["generation_settings"]["n_predict"] == 5


def test_server_seed_is_the_seed_of_requests_that_set_none() -> None:
    """llama-server's --seed: /props and generation_settings report it, and a request without a seed
    samples the same text each time (the tests of llama.cpp start every server with --seed 42)."""
    with live_server(StrataSettings(model_alias=MODEL, seed=42), FakeEngine()) as base:
        assert httpx.get(f"{base}/props").json()["default_generation_settings"]["params"]["seed"] == 42
        body = {"prompt": "abc", "n_predict": 12, "temperature": 1.5}
        first, second = (httpx.post(f"{base}/completion", json=body).json() for _ in range(2))
        assert first["generation_settings"]["seed"] == 42 and first["content"] == second["content"]
        own = httpx.post(f"{base}/completion", json={**body, "seed": 7}).json()
        assert own["generation_settings"]["seed"] == 7
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 1.5}
        replies = {httpx.post(f"{base}/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
                   for _ in range(2)}
        assert len(replies) == 1


def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_lets_only_the_named_origins_call() -> None:
    settings = StrataSettings(model_alias=MODEL, cors="https://app.example, https://other.example", api_key="k")
    assert settings.cors == ["https://app.example", "https://other.example"]
    with live_server(settings, FakeEngine()) as base:
        allowed = _preflight(base, "https://app.example")
        assert allowed.status_code == 200  # as llama-server answers
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in allowed.headers
        denied = _preflight(base, "https://evil.example")
        assert denied.status_code == 200 and "access-control-allow-origin" not in denied.headers
        call = httpx.get(f"{base}/props", headers={"Origin": "https://app.example", "X-Api-Key": "k"})
        assert call.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{base}/props", headers={"Origin": "https://evil.example", "X-Api-Key": "k"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://localhost", True), ("http://localhost:8080", True), ("https://127.0.0.1:3000", True),
    ("http://[::1]:3000", True), ("http://localhost.evil.com", False), ("http://notlocalhost", False),
    ("http://evil.com", False), ("http://127.0.0.1.evil.com", False)])
def test_cors_localhost_allows_the_pages_of_this_machine(origin: str, allowed: bool) -> None:
    """llama-server's --cors-origins localhost: any origin on this machine, any port."""
    with live_server(StrataSettings(model_alias=MODEL, cors="localhost"), FakeEngine()) as base:
        answer = _preflight(base, origin)
        assert answer.status_code == 200
        assert answer.headers.get("access-control-allow-origin") == (origin if allowed else None)
        # capitalized on the wire, as llama-server's (llama.cpp's tests look the name up in a plain dict)
        assert (b"Access-Control-Allow-Origin" in [name for name, _ in answer.headers.raw]) == allowed
        call = httpx.get(f"{base}/props", headers={"Origin": origin})
        assert call.headers.get("access-control-allow-origin") == (origin if allowed else None)


def test_no_cors_headers_by_default(url: str) -> None:
    assert "access-control-allow-origin" not in _preflight(url, "https://app.example").headers
    call = httpx.get(f"{url}/props", headers={"Origin": "https://app.example"})
    assert not any(name.startswith("access-control-") for name in call.headers)


def test_a_full_kv_pool_is_llama_servers_500() -> None:
    """A request the shared KV pool cannot hold failed for the server's memory, not for what it asked:
    a 500 saying the context size has been exceeded, as llama-server's (llama.cpp's test_completion_unified)."""
    from strata_core.model.kvpool import KVPoolFull
    from strata_core.serving.server.errors import error_body

    status, body = error_body(KVPoolFull("the KV pool of device slot 0 is full: 3 more blocks of 16 tokens needed"))
    assert status == 500 and body.error.code == "kv_pool_full"
    assert "context size has been exceeded" in body.error.message and "device slot 0" in body.error.message
