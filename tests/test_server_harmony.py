"""gpt-oss replies through the OpenAI server: the harmony text is split into ``reasoning_content`` (the
analysis channel) and ``content`` (the final channel), whole and streamed, as llama.cpp's server does;
``strata generate --chat`` writes the reasoning to stderr and the answer to stdout.

The engine is the fake one with the gpt-oss fixture's tokenizer (harmony special tokens) and chat
template, its logits scripted so greedy sampling emits a harmony reply; the scheduler, the stream
decoder, stop strings and the responses are the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_server_support import FakeEngine, FakeSession, live_server

from strata_core.text.chat import ChatTemplate
from strata_core.cli.generate import generate
from strata_core.config import StrataSettings
from strata_core.gguf.reader import GGUFFile
from strata_core.text.harmony import HarmonyParser
from strata_core.serving.requests import GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.text.tokenizer import Tokenizer

GPT_OSS = Path(__file__).parent / "data" / "gpt-oss_llamacpp" / "model-f32.gguf"
MODEL = "oss"
REASONING = "The user greets; answer briefly."
CONTENT = "Hello there, the quick fox!"
REPLY = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
         f"<|start|>assistant<|channel|>final<|message|>{CONTENT}")
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
            {"role": "user", "content": "again"}]


class HarmonyEngine(FakeEngine):
    """The fake engine speaking gpt-oss: greedy sampling after any prompt emits ``REPLY`` then ``<|return|>``."""

    def __init__(self) -> None:
        super().__init__(max_context=512)
        metadata = GGUFFile.open(GPT_OSS).metadata
        self.tokenizer = Tokenizer.from_gguf(metadata)
        self.chat = ChatTemplate.from_gguf(metadata)
        self.spec.vocab_size = self.tokenizer.vocab_size
        self.script = self.tokenizer.encode(REPLY) + self.tokenizer.encode("<|return|>")
        self.starts: dict[int, int] = {}  # session -> its length after the prompt
        self.prompts: list[list[int]] = []  # each request's whole prompt

    def next_logits(self, session: FakeSession) -> torch.Tensor:
        logits = torch.zeros(self.spec.vocab_size)
        logits[self.script[session.n_tokens - self.starts[id(session)]]] = 1.0
        return logits

    def prefill(self, session: FakeSession, token_ids: list[int]) -> torch.Tensor:
        self.starts[id(session)] = session.n_tokens + len(token_ids)
        self.prompts.append(list(session.tokens) + list(token_ids))
        return super().prefill(session, token_ids)


@pytest.fixture(scope="module")
def engine() -> HarmonyEngine:
    return HarmonyEngine()


@pytest.fixture(scope="module")
def base_url(engine: HarmonyEngine) -> Iterator[str]:
    with live_server(StrataSettings(model_alias=MODEL, parallel=1, max_queue=4, conv_cache=0), engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_the_reply_is_harmony_made_of_special_tokens(engine: HarmonyEngine) -> None:
    markers = {engine.tokenizer.encode(m)[0] for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")}
    assert markers <= set(engine.script) and len(markers) == 4
    assert "<|channel|>" not in engine.tokenizer.decode(engine.script)  # what a chat reply read like before


def test_non_streamed_reply_is_split(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == len(engine.script)


def test_streamed_reply_is_split_in_order(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                                 stream=True, logprobs=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    assert ("".join(reasoning), "".join(content)) == (REASONING, CONTENT)
    assert len(reasoning) > 1 and len(content) > 1  # streamed, not sent at the end
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, reverse=True)  # all reasoning, then all content
    assert chunks[-1].choices[0].finish_reason == "stop"
    # every generated token's logprob is sent once, in some chunk, header tokens included
    logprobs = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [lp.token for lp in logprobs] == [engine.tokenizer.decode([t]) for t in engine.script]


def test_stop_strings_and_max_tokens_cut_the_channels(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0, stop=["fox"])
    assert (cut.choices[0].message.reasoning_content, cut.choices[0].message.content) == (
        REASONING, CONTENT[: CONTENT.index("fox")])
    n = len(engine.tokenizer.encode("<|channel|>analysis<|message|>")) + 3  # into the analysis
    short = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n, temperature=0)
    reasoning = short.choices[0].message.reasoning_content
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content == ""
    assert REASONING.startswith(reasoning) and 0 < len(reasoning) < len(REASONING)


@pytest.mark.parametrize("effort, line", [(None, "Reasoning: medium"), ("high", "Reasoning: high"),
                                          ("low", "Reasoning: low")])
def test_reasoning_effort_reaches_the_template(client: openai.OpenAI, engine: HarmonyEngine, effort, line) -> None:
    extra = {} if effort is None else {"reasoning_effort": effort}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, extra_body=extra)
    assert line in engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)


def test_text_completions_are_unchanged(base_url: str, engine: HarmonyEngine) -> None:
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 200,
                                                        "temperature": 0})
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(engine.script)  # special tokens skipped


def test_generate_cli_writes_reasoning_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    engine = HarmonyEngine()
    prompt = engine.tokenizer.encode(engine.chat.render([{"role": "user", "content": "hi"}]))
    request = GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=200), keep_special_tokens=True)
    end, content = asyncio.run(generate(engine, request, HarmonyParser()))
    out = capsys.readouterr()
    assert (out.err, out.out) == (REASONING, CONTENT) and end.reason == "stop"
    assert content == CONTENT  # what strata chat keeps of the reply
