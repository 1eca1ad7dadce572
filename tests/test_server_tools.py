"""Tool calls through the OpenAI server, with the official client: tools rendered by the chat template,
the reply's ``<tool_call>`` blocks (Qwen) or harmony function calls (gpt-oss) returned as
``tool_calls``, whole and streamed, and the tool's result sent back for the final answer.

The engines are fake ones whose greedy output is scripted by the prompt they receive (the Qwen one
with Qwen2.5's chat template on the byte-level fake tokenizer, the gpt-oss one with the gpt-oss
fixture's tokenizer and template); the scheduler, the template processes and the responses are the
real ones."""

from __future__ import annotations

import contextlib

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from test_chat import QWEN_TEMPLATE
from test_server_harmony import HarmonyEngine
from test_server_support import FakeEngine, FakeSession, live_server

from strata_core.config import StrataSettings
from strata_core.text.chat import ChatTemplate

MODEL = "qwen"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
ANSWER = "It is 21 °C in Zürich."
# the reply to a prompt whose last turn holds the trigger, first match wins
SCRIPT = [("<tool_response>", ANSWER),
          ("two cities", "Checking both.\n" + CALL + "\n" + CALL.replace("Zürich", "Bern")),
          ("broken", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),
          ("weather", "Let me look.\n" + CALL),
          ("", "Hello there.")]


class ToolEngine(FakeEngine):
    """The fake engine with Qwen2.5's chat template: greedy sampling after a generation prompt emits the
    ``SCRIPT`` reply to the prompt's last turn, then ``<|im_end|>``, then all logits equal (the reply is
    read off the session's tokens, so it holds whichever way the scheduler reaches them)."""

    def __init__(self, template: str = QWEN_TEMPLATE, script: list[tuple[str, str]] = SCRIPT) -> None:
        super().__init__(max_context=2048)
        self.chat = ChatTemplate(template, eos_token="<|im_end|>")
        self.script = script
        self.opening = self.tokenizer.encode("<|im_start|>assistant\n")
        self.prompts: list[str] = []  # each request's whole prompt

    def next_logits(self, session: FakeSession) -> torch.Tensor:
        start = len(session.tokens) - session.tokens[::-1].index(self.opening[0]) - 1  # the last <|im_start|>
        assert session.tokens[start:start + len(self.opening)] == self.opening, "no generation prompt"
        prompt = self.tokenizer.decode(session.tokens[:start])
        reply = next(reply for trigger, reply in self.script if trigger in prompt.rsplit("user\n", 1)[-1])
        done = session.n_tokens - start - len(self.opening)
        if done == 0:
            self.prompts.append(prompt)
        logits = torch.zeros(self.spec.vocab_size)
        script = self.tokenizer.encode(reply + "<|im_end|>")
        if done < len(script):  # past it (a reply a grammar kept off the script): no preference
            logits[script[done]] = 1.0
        return logits


@pytest.fixture(scope="module")
def engine() -> ToolEngine:
    return ToolEngine()


def scripted_server(engine: FakeEngine) -> contextlib.AbstractContextManager[str]:
    """A one-slot live server of a scripted engine, serving it as ``MODEL``; yields the base URL."""
    return live_server(StrataSettings(model_alias=MODEL, parallel=1, max_queue=4, conv_cache=0), engine)


@pytest.fixture(scope="module")
def base_url(engine: ToolEngine) -> Iterator[str]:
    with scripted_server(engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, messages: list, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0, **extra)


def _result_turn(message) -> list[dict]:
    """The assistant's tool-call message as the client sends it back, and the tool's result."""
    call = message.tool_calls[0]
    return [{"role": "assistant", "content": message.content,
             "tool_calls": [c.model_dump() for c in message.tool_calls]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]


def test_round_trip(client: openai.OpenAI, engine: ToolEngine) -> None:
    out = ask(client, ASK, tools=TOOLS)
    assert "get_weather" in engine.prompts[-1] and "The current weather in a city, in °C" in engine.prompts[-1]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})

    final = ask(client, ASK + _result_turn(choice.message), tools=TOOLS)
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == (ANSWER, "stop")
    assert final.choices[0].message.tool_calls is None
    # the earlier call is rendered with its arguments as an object, and the result as a tool response
    assert 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in engine.prompts[-1]
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in engine.prompts[-1]


def test_streamed_round_trip(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                        temperature=0) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        out = stream.get_final_completion()
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1 and not any("<" in text for text in content)  # streamed, the block held back
    [delta] = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert (delta.index, delta.id, delta.type, delta.function.name) == (0, call.id, "function", "get_weather")

    final = list(client.chat.completions.create(model=MODEL, messages=ASK + _result_turn(choice.message), tools=TOOLS,
                                                max_tokens=200, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in final if c.choices) == ANSWER
    assert final[-1].choices[0].finish_reason == "stop"


def test_two_calls_stream_with_their_indexes(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "two cities"}],
                                                 tools=TOOLS, max_tokens=200, temperature=0, stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [(c.index, json.loads(c.function.arguments)["city"]) for c in calls] == [(0, "Zürich"), (1, "Bern")]
    assert calls[0].id != calls[1].id and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first(client: openai.OpenAI) -> None:
    out = ask(client, [{"role": "user", "content": "two cities"}], tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in out.choices[0].message.tool_calls] == ["Zürich"]


def test_bad_json_in_a_block_is_content(client: openai.OpenAI) -> None:
    out = ask(client, [{"role": "user", "content": "broken"}], tools=TOOLS)
    assert out.choices[0].message.content == SCRIPT[2][1] and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


def test_tool_choice_none_renders_no_tools(client: openai.OpenAI, engine: ToolEngine) -> None:
    out = ask(client, ASK, tools=TOOLS, tool_choice="none")
    assert "get_weather" not in engine.prompts[-1] and "# Tools" not in engine.prompts[-1]
    assert out.choices[0].message.content == "Let me look.\n" + CALL  # not read as a call either
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_renders_the_tools_and_constrains_the_reply(client: openai.OpenAI, engine: ToolEngine,
                                                                       choice) -> None:
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 8
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=400,
                                         temperature=0, tools=tools, tool_choice=choice)
    assert "get_weather" in engine.prompts[-1]
    assert out.choices[0].finish_reason == "tool_calls", repr(out.choices[0].message.content)
    (call,) = out.choices[0].message.tool_calls  # the scripted "Hello there." is not allowed: a call is
    assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) <= 8


def test_strict_tools_keep_text_and_valid_calls(client: openai.OpenAI) -> None:
    """A ``strict`` tool under ``tool_choice`` auto: the reply is constrained (text, or calls valid for the
    schema), and the scripted text and call come through as they are."""
    strict = json.loads(json.dumps(TOOLS))
    strict[0]["function"]["strict"] = True
    out = ask(client, ASK, tools=strict)
    [call] = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})
    assert out.choices[0].message.content == "Let me look."
    text = ask(client, [{"role": "user", "content": "hi"}], tools=strict)
    assert (text.choices[0].message.content, text.choices[0].finish_reason) == ("Hello there.", "stop")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
])
def test_tools_and_tool_choice_that_cannot_be_met_are_400(base_url: str, extra: dict, param: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": ASK, **extra})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["param"], r.text


def test_text_completions_refuse_tools(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# --- a template that knows no tools: the generic JSON format -----------------------------------------

PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERIC_CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}]}'
GENERIC_SCRIPT = [("Tool result", json.dumps({"response": ANSWER}, ensure_ascii=False)), ("weather", GENERIC_CALL),
                  ("", "Hello there.")]


@pytest.fixture(scope="module")
def generic_engine() -> ToolEngine:
    return ToolEngine(PLAIN_TEMPLATE, GENERIC_SCRIPT)


@pytest.fixture(scope="module")
def generic_client(generic_engine: ToolEngine) -> Iterator[openai.OpenAI]:
    with scripted_server(generic_engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_generic_round_trip(generic_client: openai.OpenAI, generic_engine: ToolEngine) -> None:
    """The tools described in a system message; the JSON reply's calls as ``tool_calls``; the call and the
    tool's result given back as plain turns; a ``{"response": ...}`` reply as content."""
    out = ask(generic_client, ASK, tools=TOOLS)
    prompt = generic_engine.prompts[-1]
    assert prompt.startswith("system\nYou can call these tools") and "The current weather" in prompt  # specials skipped
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})
    final = ask(generic_client, ASK + _result_turn(choice.message), tools=TOOLS)
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == (ANSWER, "stop")
    prompt = generic_engine.prompts[-1]
    assert f"assistant\n{GENERIC_CALL}\n" in prompt
    assert f'user\nTool result ({call.id}):\n{{"temp": 21}}\n' in prompt


def test_generic_streamed_call(generic_client: openai.OpenAI) -> None:
    with generic_client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                temperature=0) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})


def test_generic_text_reply_streams_as_content(generic_client: openai.OpenAI) -> None:
    out = ask(generic_client, [{"role": "user", "content": "hi"}], tools=TOOLS)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("Hello there.", "stop")


def test_generic_forced_tool_choice(generic_client: openai.OpenAI) -> None:
    """A forced call on a template without tools: the grammar of ``{"tool_calls": [...]}`` keeps the
    scripted text reply off; the call's arguments are valid for the schema. (Off its script the fake
    engine's logits are all equal: greedy takes the lowest id the grammar allows, a tab, wherever JSON
    allows white space, up to its limit: hence the many tokens; and "," before "]": one call, so the list
    ends.)"""
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 8
    out = generic_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1200, temperature=0, tools=tools, tool_choice="required",
                                                 parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls", repr(out.choices[0].message.content)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) <= 8


# --- <think> reasoning (a template whose generation prompt opens the block, as DeepSeek-R1's) ----------

THINK_TEMPLATE = QWEN_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
THINK_SCRIPT = [("weather", "<think>\nA call, then.</think>\n\n" + CALL), ("", "<think>\nThinking it over.\n</think>\n\nHello.")]


@pytest.fixture(scope="module")
def think_client() -> Iterator[openai.OpenAI]:
    engine = ToolEngine(THINK_TEMPLATE, THINK_SCRIPT)
    engine.opening = engine.tokenizer.encode("<|im_start|>assistant\n")  # the script's reply starts with <think>
    with scripted_server(engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_think_block_is_reasoning_content(think_client: openai.OpenAI) -> None:
    out = ask(think_client, [{"role": "user", "content": "hi"}])
    message = out.choices[0].message
    assert (message.content, message.reasoning_content) == ("Hello.", "Thinking it over.\n")
    assert THINK_TEMPLATE != QWEN_TEMPLATE


def test_think_then_tool_call(think_client: openai.OpenAI) -> None:
    """A call after the reasoning; forced, the grammar lets the opened block finish first."""
    for choice in ("auto", "required"):
        out = ask(think_client, ASK, tools=TOOLS, tool_choice=choice)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.reasoning_content == "A call, then."
        [call] = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Zürich"})


# --- gpt-oss ----------------------------------------------------------------------------------------

HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}')


class HarmonyToolEngine(HarmonyEngine):
    """gpt-oss calling ``get_weather``: greedy sampling emits ``HARMONY_CALL`` then ``<|call|>``."""

    def __init__(self) -> None:
        super().__init__()
        self.max_context = self.spec.context_length = 4096  # the tools' rendering is long
        self.script = self.tokenizer.encode(HARMONY_CALL) + self.tokenizer.encode("<|call|>")


@pytest.fixture(scope="module")
def harmony_engine() -> HarmonyToolEngine:
    return HarmonyToolEngine()


@pytest.fixture(scope="module")
def harmony_client(harmony_engine: HarmonyToolEngine) -> Iterator[openai.OpenAI]:
    with scripted_server(harmony_engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_harmony_function_call(harmony_client: openai.OpenAI, harmony_engine: HarmonyToolEngine) -> None:
    out = ask(harmony_client, ASK, tools=TOOLS)
    assert "get_weather" in harmony_engine.tokenizer.decode(harmony_engine.prompts[-1], skip_special_tokens=False)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content, out.choices[0].finish_reason) == (
        "Need the weather.", None, "tool_calls")
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    ask(harmony_client, ASK + _result_turn(message), tools=TOOLS)  # the call and its result go through the template
    prompt = harmony_engine.tokenizer.decode(harmony_engine.prompts[-1], skip_special_tokens=False)
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in prompt


def test_harmony_function_call_streamed(harmony_client: openai.OpenAI) -> None:
    paris = [{"role": "user", "content": "And in Paris?"}]  # a new prompt: the fake's script starts at its prefill
    with harmony_client.chat.completions.stream(model=MODEL, messages=paris, tools=TOOLS, max_tokens=200,
                                                temperature=0) as stream:
        out = stream.get_final_completion()
    [call] = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert out.choices[0].finish_reason == "tool_calls"


def test_harmony_without_tools_drops_the_call(harmony_client: openai.OpenAI) -> None:
    out = ask(harmony_client, ASK)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == ""
    assert out.choices[0].finish_reason == "stop"
