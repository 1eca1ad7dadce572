"""``/v1/responses`` with the official ``openai`` client: text, instructions, a tool round trip through
``function_call`` / ``function_call_output`` items, whole and streamed, and the refusals.

The engines are the scripted fakes of test_server_tools.py (Qwen2.5's template; gpt-oss's harmony)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_server_tools import ANSWER, HarmonyToolEngine, MODEL, ToolEngine, scripted_server


TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city, in °C",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]


@pytest.fixture(scope="module")
def engine() -> ToolEngine:
    return ToolEngine()


@pytest.fixture(scope="module")
def base_url(engine: ToolEngine) -> Iterator[str]:
    with scripted_server(engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_text_input(client: openai.OpenAI, engine: ToolEngine) -> None:
    out = client.responses.create(model=MODEL, input="hi", instructions="Be brief.", max_output_tokens=50,
                                  temperature=0)
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    [message] = out.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert out.output_text == "Hello there."
    assert out.usage.output_tokens == len("Hello there.") + 1 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert engine.prompts[-1] == "system\nBe brief.\nuser\nhi\n"  # (the decoded prompt drops the special tokens)


def test_max_output_tokens_cuts_the_response(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    assert (out.status, out.incomplete_details.reason, out.output_text) == ("incomplete", "max_output_tokens", "Hel")


def test_tool_round_trip(client: openai.OpenAI, engine: ToolEngine) -> None:
    out = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=200, temperature=0)
    assert "The current weather in a city, in °C" in engine.prompts[-1]
    message, call = out.output
    assert (message.type, out.output_text) == ("message", "Let me look.")
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Zürich"}, "completed")

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    final = client.responses.create(model=MODEL, input=ASK + [item.model_dump() for item in out.output] + [result],
                                    tools=TOOLS, max_output_tokens=200, temperature=0)
    assert (final.output_text, [item.type for item in final.output]) == (ANSWER, ["message"])
    # the call went back as the assistant's tool call (with its text), the output as a tool response
    assert 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in engine.prompts[-1]
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in engine.prompts[-1]


def test_streamed_tool_round_trip(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        out = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Let me look." == out.output_text
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert (done.name, json.loads(done.arguments)) == ("get_weather", {"city": "Zürich"})
    call = out.output[1]
    assert call.type == "function_call" and done.item_id == call.id

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    events = list(client.responses.create(model=MODEL, input=ASK + [item.model_dump() for item in out.output] + [result],
                                          tools=TOOLS, max_output_tokens=200, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert events[-1].response.output_text == ANSWER


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_cannot_be_served_is_400(base_url: str, body: dict, param: str) -> None:
    r = httpx.post(f"{base_url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_previous_response_id_says_nothing_is_stored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


@pytest.fixture(scope="module")
def harmony_client() -> Iterator[openai.OpenAI]:
    with scripted_server(HarmonyToolEngine()) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_harmony_reasoning_and_call_stream_as_items(harmony_client: openai.OpenAI) -> None:
    with harmony_client.responses.stream(model=MODEL, input=ASK, tools=TOOLS, max_output_tokens=200,
                                         temperature=0) as stream:
        events = list(stream)
        out = stream.get_final_response()
    reasoning, call = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Need the weather."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_the_api_docs_list_the_responses_and_messages_routes(base_url: str) -> None:
    schema = httpx.get(f"{base_url}/schema/openapi.json").json()
    ops = {op["operationId"] for path in schema["paths"].values() for op in path.values()}
    assert {"createResponse", "createMessage", "countMessageTokens"} <= ops
