"""``/v1/messages`` and ``/v1/messages/count_tokens`` with the official ``anthropic`` client: text, system,
stop reasons, a tool round trip through ``tool_use`` / ``tool_result`` blocks, whole and streamed, and
errors in Anthropic's shape.

The engine is the scripted fake of test_server_tools.py (Qwen2.5's template)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from test_server_support import live_server
from test_server_tools import ANSWER, MODEL, ToolEngine, scripted_server

from strata_core.config import StrataSettings

TOOLS = [{"name": "get_weather", "description": "The current weather in a city, in °C",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]
GREEDY = {"temperature": 0}  # (this client has no temperature parameter: it is sent as an extra field)


@pytest.fixture(scope="module")
def engine() -> ToolEngine:
    return ToolEngine()


@pytest.fixture(scope="module")
def base_url(engine: ToolEngine) -> Iterator[str]:
    with scripted_server(engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def ask(client: anthropic.Anthropic, messages: list, **extra) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, messages=messages, max_tokens=200, extra_body=GREEDY, **extra)


def test_text_with_system(client: anthropic.Anthropic, engine: ToolEngine) -> None:
    out = ask(client, [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
              system=[{"type": "text", "text": "Be brief."}])
    assert out.id.startswith("msg_") and (out.type, out.role, out.model) == ("message", "assistant", MODEL)
    assert [(b.type, b.text) for b in out.content] == [("text", "Hello there.")]
    assert (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    assert out.usage.output_tokens == len("Hello there.") + 1
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > 0
    assert engine.prompts[-1] == "system\nBe brief.\nuser\nhi\n"  # (the decoded prompt drops the special tokens)


def test_stop_reasons(client: anthropic.Anthropic) -> None:
    out = client.messages.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                 extra_body=GREEDY)
    assert (out.content[0].text, out.stop_reason) == ("Hel", "max_tokens")
    out = ask(client, [{"role": "user", "content": "hi"}], stop_sequences=["there"])
    assert (out.content[0].text, out.stop_reason, out.stop_sequence) == ("Hello ", "stop_sequence", "there")


def test_tool_round_trip(client: anthropic.Anthropic, engine: ToolEngine) -> None:
    out = ask(client, ASK, tools=TOOLS)
    assert "The current weather in a city, in °C" in engine.prompts[-1]
    text, use = out.content
    assert (text.type, text.text, out.stop_reason) == ("text", "Let me look.", "tool_use")
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert (use.name, use.input) == ("get_weather", {"city": "Zürich"})

    turn = [{"role": "assistant", "content": [block.model_dump() for block in out.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp": 21}'}]}]
    final = ask(client, ASK + turn, tools=TOOLS)
    assert ([b.text for b in final.content], final.stop_reason) == ([ANSWER], "end_turn")
    assert 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in engine.prompts[-1]
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in engine.prompts[-1]


def test_streamed_tool_call(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        out = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert len(texts) > 1 and "".join(texts) == "Let me look."
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "text"), (1, "tool_use")]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    assert (out.content[1].name, out.content[1].input, out.stop_reason) == ("get_weather", {"city": "Zürich"}, "tool_use")
    assert out.usage.output_tokens > 0


def test_streamed_text(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == "Hello there."
        assert stream.get_final_message().stop_reason == "end_turn"


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, system="Be brief.")
    out = ask(client, ASK, tools=TOOLS, system="Be brief.")
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize(("body", "needle"), [
    ({"messages": ASK}, "max_tokens is required"),
    ({"max_tokens": 10}, "messages"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image input is not supported"),
    ({"max_tokens": 10, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool"),
    ({"max_tokens": 10, "messages": ASK, "tool_choice": {"type": "tool"}}, "needs the tool's name"),
])
def test_errors_have_anthropics_shape(base_url: str, body: dict, needle: str) -> None:
    r = httpx.post(f"{base_url}/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert needle in error["error"]["message"], error


def test_the_client_raises_on_an_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):
        ask(client, [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])


def test_a_wrong_api_key_is_an_anthropic_401(engine: ToolEngine) -> None:
    with live_server(StrataSettings(model_alias=MODEL, parallel=1, api_key="k", conv_cache=0), engine) as url:
        bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            bad.messages.count_tokens(model=MODEL, messages=ASK)
        assert raised.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)  # sent as X-Api-Key
        assert good.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
