"""Many clients at once on a live server (fake engine): batching, disconnects, cached KV blocks and the
conversation cache."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from test_server_support import FakeBlocks, FakeEngine, FakeTokenizer, greedy_reference, live_server, steps_of

from strata_core.config import StrataSettings

MODEL = "demo"


async def _stream_chat(client: openai.AsyncOpenAI, text: str, max_tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def anchor_line(lines) -> str:  # type: ignore[no-untyped-def]
    """The next non-empty line of a streamed response."""
    async for line in lines:
        if line:
            return line
    raise AssertionError("the stream ended")


def _alone(text: str, max_tokens: int) -> str:
    tok = FakeTokenizer()
    prompt = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    return tok.decode(greedy_reference(prompt, max_tokens))


def test_sixteen_streaming_clients_on_four_slots_beside_a_long_stream() -> None:
    engine = FakeEngine(step_delay=0.002)
    prompts = [(f"client {i} says hi", 5 + i % 7) for i in range(16)]

    async def main(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        # one long greedy stream decodes throughout, so every later step has decode rows (a step without
        # any may take --prefill-chunk tokens, and ``steps_of`` could not tell it from the step before)
        payload = {"model": MODEL, "prompt": long_running_prompt("anchor", 200), "max_tokens": 200, "temperature": 0,
                   "stream": True}
        async with httpx.AsyncClient() as http, http.stream("POST", f"{url}/v1/completions", json=payload) as anchor:
            lines = anchor.aiter_lines()
            assert (await anchor_line(lines)).startswith("data: ")
            return await asyncio.gather(*(_stream_chat(client, text, n) for text, n in prompts))

    with live_server(StrataSettings(model_alias=MODEL, parallel=5, max_queue=16, step_tokens=16), engine) as url:
        outputs = asyncio.run(main(url))
        metrics = httpx.get(f"{url}/metrics").text
    assert outputs == [_alone(text, n) for text, n in prompts]
    assert max(engine.windows) == 5  # the slots were batched
    assert "strata_requests_total 16.0" in metrics and "strata_steps_total" in metrics
    steps = steps_of(engine.calls)
    assert all(rows + prompt <= 16 for rows, prompt in steps)  # --step-tokens reached the scheduler
    assert any(prompt for _, prompt in steps)  # prompts were computed beside decode rows


def test_queue_overflow_is_503_with_a_message() -> None:
    engine = FakeEngine(max_context=4096, step_delay=0.005)
    with live_server(StrataSettings(model_alias=MODEL, parallel=1, max_queue=0), engine) as url:
        # greedy on a prompt whose fake continuation runs long: the slot stays taken (a sampled one
        # could draw the end of sequence at once and free it before the second request comes)
        payload = {"model": MODEL, "prompt": long_running_prompt("busy"), "max_tokens": 3000, "temperature": 0,
                   "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=payload) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # the slot is taken (and the stream kept open)
            refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "me too"})
        assert refused.status_code == 503
        assert "busy" in refused.json()["error"]["message"]


def long_running_prompt(stem: str, tokens: int = 400) -> str:
    """A prompt whose fake greedy continuation does not reach an end-of-sequence token soon."""
    tokenizer = FakeTokenizer()
    for i in range(1000):
        text = f"{stem} {i}"
        if len(greedy_reference(tokenizer.encode(text), tokens)) == tokens:
            return text
    raise AssertionError("no long-running prompt found")


def test_a_client_that_disconnects_frees_its_slot() -> None:
    engine = FakeEngine(max_context=4096, step_delay=0.005)
    with live_server(StrataSettings(model_alias=MODEL, parallel=1, max_queue=1), engine) as url:
        payload = {"model": MODEL, "prompt": long_running_prompt("never ending"), "max_tokens": 4000,
                   "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=payload) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generating; then hang up
        # 4000 windows would take 20 s: only a freed slot lets this finish within the timeout
        done = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 3},
                          timeout=10)
        assert done.status_code == 200
        non_stream = {"model": MODEL, "prompt": long_running_prompt("also long"), "max_tokens": 4000,
                      "temperature": 0}
        try:
            httpx.post(f"{url}/v1/completions", json=non_stream, timeout=0.5)
        except httpx.ReadTimeout:
            pass  # the client gave up on a non-streamed request
        done = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "last", "max_tokens": 3},
                          timeout=10)
        assert done.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
    assert "strata_requests_cancelled_total 2.0" in metrics, metrics


@pytest.mark.parametrize("rewindable", [True, False])
def test_second_turn_reads_its_history_from_cached_blocks_or_the_conversation_cache(rewindable: bool) -> None:
    """A displaced conversation's second turn reads its history: a model without recurrent state from
    the KV blocks its session left cached (whatever --conv-cache), one with recurrent state from the
    conversation cache in host RAM; /metrics counts the blocks taken back."""
    def converse(conv_cache: int) -> tuple[list[str], list[dict], dict[str, float]]:
        settings = StrataSettings(model_alias=MODEL, parallel=1, conv_cache=conv_cache)
        with live_server(settings, FakeEngine(rewindable=rewindable)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            history = [{"role": "user", "content": "tell me a story"}]
            first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
            other = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "other"}],
                                                   max_tokens=3, temperature=0)  # displaces the conversation
            history += [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "go on"}]
            second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
            text = httpx.get(f"{url}/metrics").text
        metrics = {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                          if line.startswith("strata_kv_cached_block"))}
        return ([first.choices[0].message.content, second.choices[0].message.content],
                [r.model_extra["timings"] for r in (first, second, other)], metrics)

    cached_texts, cached, metrics = converse(conv_cache=2)
    plain_texts, plain, _ = converse(conv_cache=0)
    assert cached_texts == plain_texts
    prompt_one, block = cached[0]["prompt_n"], FakeBlocks().block
    taken = sum(t["cache_n"] for t in cached) // block if rewindable else 0  # "other" shares the template's opening
    assert metrics == {"strata_kv_cached_block_hits_total": taken,
                       "strata_kv_cached_block_evictions_total": 0.0,
                       "strata_kv_cached_blocks": metrics["strata_kv_cached_blocks"]}
    assert (metrics["strata_kv_cached_blocks"] > 0) == rewindable
    assert cached[1]["cache_n"] >= prompt_one // block * block  # the first prompt's whole blocks, at least
    assert cached[1]["prompt_n"] + cached[1]["cache_n"] == plain[1]["prompt_n"] + plain[1]["cache_n"]
    assert plain[1]["cache_n"] == (cached[1]["cache_n"] if rewindable else 0)
