"""Structured output through the server: ``response_format`` (json_object, json_schema), llama-server's
``grammar`` (GBNF) and ``json_schema`` on the chat, text and native completion routes, the server-wide
``--json-schema``, and forced tool calls (``tool_choice`` "required" or a named function) in Qwen's
``<tool_call>`` and gpt-oss's harmony wrappers; the output is checked against its schema (jsonschema) or
grammar, over random schemas (hypothesis). The engines are fake ones with random logits (a random
model is the hardest client a grammar can have); the scheduler, the sampler and the server are real."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat import QWEN_TEMPLATE
from test_server_harmony import HarmonyEngine
from test_server_support import FakeEngine, FakeSession, live_server

from strata_core.config import StrataSettings
from strata_core.text.chat import ChatTemplate

MODEL = "fake"
ASK = [{"role": "user", "content": "Answer in JSON."}]
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "tag": {"enum": ["a", "b"]}},
         "required": ["x", "tag"], "additionalProperties": False}
NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


def _leaves() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-100, 100), st.integers(0, 1000)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "number", "minimum": -5, "maximum": 5}),
        st.just({"type": "boolean"}),
        st.lists(st.text(alphabet="xyz é", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}),
    )


def _objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


def _containers(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    arrays = st.tuples(children, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})
    return st.one_of(arrays, _objects(children))


#: objects with required properties of every leaf type, arrays and objects nested
SCHEMAS = _objects(st.recursive(_leaves(), _containers, max_leaves=6))


class RandomEngine(FakeEngine):
    """The fake engine's random logits, with Qwen2.5's chat template (tools in ``<tool_call>`` blocks)."""

    def __init__(self) -> None:
        super().__init__(max_context=8192)
        self.chat = ChatTemplate(QWEN_TEMPLATE, eos_token="<|im_end|>")


class RandomHarmonyEngine(HarmonyEngine):
    """gpt-oss's tokenizer and chat template with random logits."""

    def __init__(self) -> None:
        super().__init__()
        self.max_context = self.spec.context_length = 2048

    def next_logits(self, session: FakeSession) -> torch.Tensor:
        seed = hash(tuple(session.tokens)) % 2**32
        return torch.randn(self.spec.vocab_size, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=4, conv_cache=0), RandomEngine()) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _chat(url: str, **fields: object) -> dict:
    payload = {"messages": ASK, "max_tokens": 1500, "temperature": 1.0, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_json_schema_output_validates(url: str, schema: dict, seed: int) -> None:
    choice = _chat(url, seed=seed, response_format={"type": "json_schema",
                                                    "json_schema": {"name": "out", "schema": schema, "strict": True}})
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_llama_server_fields(url: str) -> None:
    value = json.loads(_chat(url, seed=1, response_format={"type": "json_object"})["message"]["content"])
    assert isinstance(value, dict)
    jsonschema.validate(json.loads(_chat(url, seed=2, json_schema=POINT)["message"]["content"]), POINT)
    shaped = _chat(url, seed=3, response_format={"type": "json_object", "schema": POINT})  # llama-server's form
    jsonschema.validate(json.loads(shaped["message"]["content"]), POINT)
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "p:", "max_tokens": 500, "seed": 4,
                                                     "json_schema": POINT}).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), POINT)
    native = httpx.post(f"{url}/completion", json={"prompt": "p:", "seed": 5, "json_schema": POINT}).json()
    jsonschema.validate(json.loads(native["content"]), POINT)


GBNF = r"""root ::= "(" list ")"
list ::= item ("," item){0,3}
item ::= [0-9]{1,3} | "'" [a-z]{0,4} "'" | "nil"
"""
PARSED = re.compile(r"\((\d{1,3}|'[a-z]{0,4}'|nil)(,(\d{1,3}|'[a-z]{0,4}'|nil)){0,3}\)")


@pytest.mark.parametrize("route", ["chat", "completions", "completion"])
def test_grammar_output_parses(url: str, route: str) -> None:
    for seed in range(3):
        if route == "chat":
            text = _chat(url, seed=seed, grammar=GBNF)["message"]["content"]
        elif route == "completions":
            text = httpx.post(f"{url}/v1/completions", json={"prompt": "p", "seed": seed, "max_tokens": 200,
                                                             "grammar": GBNF}).json()["choices"][0]["text"]
        else:
            text = httpx.post(f"{url}/completion", json={"prompt": "p", "seed": seed, "grammar": GBNF}).json()["content"]
        assert PARSED.fullmatch(text), text


def test_openai_client_response_format(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, seed=7,
                                         max_tokens=500)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), POINT)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, seed=7,
                                            max_tokens=500, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
    obj = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=8,
                                         max_tokens=500)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json_schema", "strin"),
    ({"grammar": 'root ::= "a" | missing'}, "grammar", "missing"),
    ({"grammar": "root ::= ("}, "grammar", "GBNF"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar", "one of them"),
])
def test_bad_constraints_are_400(url: str, fields: dict, param: str, words: str) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_server_wide_json_schema() -> None:
    with live_server(StrataSettings(model_alias=MODEL, json_schema=json.dumps(POINT)), RandomEngine()) as base:
        jsonschema.validate(json.loads(_chat(base, seed=9)["message"]["content"]), POINT)
        assert _chat(base, seed=9, grammar='root ::= "ok"')["message"]["content"] == "ok"  # a request's own wins
    with pytest.raises(ValueError, match="--json-schema"):
        StrataSettings(json_schema='{"type": "foo"}')


def _tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "a tool", "parameters": schema}}


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=2), named=st.booleans(), seed=st.integers(0, 2**32))
def test_forced_tool_calls_have_valid_arguments(url: str, schemas: list[dict], named: bool, seed: int) -> None:
    tools = [_tool(f"tool_{i}", schema) for i, schema in enumerate(schemas)]
    choice = {"type": "function", "function": {"name": "tool_0"}} if named else "required"
    out = _chat(url, seed=seed, tools=tools, tool_choice=choice, parallel_tool_calls=False)
    assert out["finish_reason"] == "tool_calls", out
    (call,) = out["message"]["tool_calls"]
    index = int(call["function"]["name"].removeprefix("tool_"))
    assert not named or index == 0
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[index])


def test_forced_parallel_tool_calls(url: str) -> None:
    out = _chat(url, seed=11, tools=[_tool("point", POINT)], tool_choice="required")
    assert out["finish_reason"] == "tool_calls" and out["message"]["tool_calls"]
    for call in out["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), POINT)


def test_forced_harmony_tool_call() -> None:
    """A forced call to ``point``: its arguments valid, whether the random model first writes an analysis
    message (which the grammar allows) or not; ``<|end|>`` favoured so that a random analysis ends."""
    engine = RandomHarmonyEngine()
    (end,) = engine.tokenizer.encode("<|end|>")
    with live_server(StrataSettings(model_alias=MODEL, conv_cache=0), engine) as base:
        for seed in range(3):
            out = _chat(base, seed=seed, max_tokens=300, tools=[_tool("point", POINT)], logit_bias={str(end): 12},
                        tool_choice={"type": "function", "function": {"name": "point"}})
            assert out["finish_reason"] == "tool_calls", out
            (call,) = out["message"]["tool_calls"]
            assert call["function"]["name"] == "point"
            jsonschema.validate(json.loads(call["function"]["arguments"]), POINT)


def test_response_format_on_the_real_engine(tiny_model_factory) -> None:
    """A tiny model with its GGUF's BPE tokenizer (merged tokens, specials): the mask is built from the
    real tokenizer and the JSON validates."""
    path = tiny_model_factory()
    with live_server(StrataSettings(model=path, model_alias=MODEL, max_context=512, parallel=2)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        response_format = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
        out = client.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format, seed=3,
                                             max_tokens=200)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), POINT)
