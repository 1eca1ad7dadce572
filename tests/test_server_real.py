"""End to end on the real engine and a tiny model: the openai client against a live server.

References come from a second engine in the test thread running each request alone
(``Engine.stream``, batch of one, no prefix reuse).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_server_support import live_server

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.plugin.manager import build_plugin_manager
from strata_core.serving.sampling import SamplingParams

MODEL = "tiny"
CONTEXT = 256


@pytest.fixture(scope="module")
def model_path(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[Engine]:
    engine = Engine.load(model_path, max_context=CONTEXT)
    yield engine
    engine.close()


def _settings(model_path: Path, **kw: object) -> StrataSettings:
    return StrataSettings(model=model_path, model_alias=MODEL, max_context=CONTEXT, **kw)  # type: ignore[arg-type]


def _alone(engine: Engine, messages: list[dict], max_tokens: int) -> str:
    prompt = engine.chat.render(messages)
    return "".join(engine.stream(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)))


def test_openai_client_on_the_real_engine(model_path: Path, reference: Engine) -> None:
    messages = [{"role": "user", "content": "the experts lived in host memory"}]
    with live_server(_settings(model_path, parallel=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        text = client.completions.create(model=MODEL, prompt="The engine", max_tokens=5, temperature=0)
    assert out.choices[0].message.content == streamed == _alone(reference, messages, 5) != ""
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(reference.chat.render(messages)))
    assert text.choices[0].text == "".join(reference.stream("The engine", SamplingParams(temperature=0, max_tokens=5)))


def test_sixteen_streaming_clients_equal_their_runs_alone(model_path: Path, reference: Engine) -> None:
    conversations = [[{"role": "user", "content": f"expert {i} was routed"}] for i in range(16)]

    async def one(client: openai.AsyncOpenAI, messages: list[dict]) -> str:
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                      stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(client, m) for m in conversations))

    with live_server(_settings(model_path, parallel=4, max_queue=16)) as url:
        outputs = asyncio.run(main(url))
    assert outputs == [_alone(reference, m, 3) for m in conversations]
    assert len(set(outputs)) > 1  # distinct, non-trivial outputs


def test_second_turn_from_cached_blocks_equals_a_run_without_them(model_path: Path) -> None:
    """A displaced conversation's second turn takes back the KV blocks its first turn left cached on the
    device (counted in /metrics) and gives the text a fresh server gives the same request."""
    history = [{"role": "user", "content": "the hot experts were cached"}]

    def ask(url: str) -> openai.types.chat.ChatCompletion:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        return client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)

    with live_server(_settings(model_path, parallel=1)) as url:
        first = ask(url)
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "cold"}], max_tokens=1, temperature=0)  # takes the slot
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
        second = ask(url)
        metrics = httpx.get(f"{url}/metrics").text
    with live_server(_settings(model_path, parallel=1)) as url:
        alone = ask(url)
    cached, plain = second.model_extra["timings"], alone.model_extra["timings"]
    assert second.choices[0].message.content == alone.choices[0].message.content and first.choices[0].message.content
    assert cached["cache_n"] > 10 and plain["cache_n"] == 0
    assert cached["prompt_n"] + cached["cache_n"] == plain["prompt_n"]
    hits = next(float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("strata_kv_cached_block_hits_total "))
    assert hits * 16 >= cached["cache_n"]  # --kv-block 16: the second turn's blocks, taken back


@pytest.mark.parametrize("strategy", sorted(build_plugin_manager(StrataSettings()).strategies))
def test_every_installed_strategy_serves_single_s_greedy_text(model_path: Path, reference: Engine, strategy: str,
                                                             logical_devices: list[str]) -> None:
    with live_server(_settings(model_path, strategy=strategy, devices=logical_devices)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        text = client.completions.create(model=MODEL, prompt="The experts", max_tokens=6, temperature=0)
    expected = "".join(reference.stream("The experts", SamplingParams(temperature=0, max_tokens=6)))
    assert text.choices[0].text == expected


def test_timings_report_each_request_s_expert_traffic(model_path: Path) -> None:
    with live_server(_settings(model_path, expert_cache=0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt="The experts lived in host memory", max_tokens=4,
                                        temperature=0)
    experts = out.model_extra["timings"]["experts"]
    assert experts["prompt"]["hit_rate"] == 0.0 and experts["prompt"]["bytes_streamed"] > 0
    assert experts["decode"]["bytes_streamed"] > 0 and experts["decode"]["compute_ms"] > 0


def test_metrics_count_each_device_slot_s_experts(model_path: Path) -> None:
    with live_server(_settings(model_path, strategy="layer_split", devices=["cpu", "cpu"], expert_cache=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt="The experts", max_tokens=3, temperature=0)
        metrics = httpx.get(f"{url}/metrics").text
    served = {line.split("{")[1].split("}")[0]: float(line.split()[-1])
              for line in metrics.splitlines() if line.startswith("strata_experts_served_total{")}
    for device in ("cpu#0", "cpu#1"):
        assert served[f'device="{device}",source="resident"'] > 0 and served[f'device="{device}",source="streamed"'] > 0


def test_a_prompt_computed_in_chunks_beside_a_decoding_stream_equals_its_run_alone(model_path: Path,
                                                                                   reference: Engine) -> None:
    """On the real engine a prompt that arrives while a stream decodes is computed in --step-tokens
    chunks between the stream's windows, and both give the greedy text they give alone."""
    from strata_core.serving.requests import Delta, GenerationRequest
    from strata_core.serving.scheduler import Scheduler

    engine = Engine.load(model_path, max_context=CONTEXT)
    chunks: list[int] = []
    prefill = engine.prefill_batch  # the scheduler's prompt chunks, each one's length recorded
    engine.prefill_batch = lambda batch: (chunks.extend(len(t) for _, t in batch), prefill(batch))[1]  # type: ignore[method-assign]
    scheduler = Scheduler(engine, parallel=2, max_queue=0, conv_cache=0, conv_cache_bytes=0, step_tokens=8)
    prompts = [engine.tokenizer.encode("The experts lived in host memory"),
               engine.tokenizer.encode("and the hot ones were cached on the device, " * 3)]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=4)]

    async def text(handle) -> str:  # type: ignore[no-untyped-def]
        return "".join([event.text async for event in handle if isinstance(event, Delta)])

    async def main() -> list[str]:
        stream = scheduler.submit(GenerationRequest(prompts[0], params[0]))
        first = await stream.events.get()  # the stream decodes from here on
        rest = asyncio.ensure_future(text(stream))
        late = await text(scheduler.submit(GenerationRequest(prompts[1], params[1])))
        return [first.text + await rest, late]

    scheduler.start()
    try:
        outputs = asyncio.run(main())
    finally:
        scheduler.stop()
        engine.close()
    assert outputs == ["".join(reference.stream(p, sp)) for p, sp in zip(prompts, params)]
    assert chunks[0] == len(prompts[0]) and len(chunks) > 2 and max(chunks[1:]) <= 7  # beside one decode row
    assert sum(chunks[1:]) == len(prompts[1])


def test_a_request_sharing_a_running_request_s_prompt_opening_shares_its_kv_blocks(reference: Engine,
                                                                                   model_path: Path) -> None:
    """A prompt that begins like a running request's starts holding that request's published KV blocks
    (computing only its tail) and gives the greedy text it gives alone."""
    from strata_core.serving.requests import Delta, Finished, GenerationRequest
    from strata_core.serving.scheduler import Scheduler

    engine = Engine.load(model_path, max_context=CONTEXT)
    scheduler = Scheduler(engine, parallel=2, max_queue=0, conv_cache=0, conv_cache_bytes=0, step_tokens=512)
    opening = engine.tokenizer.encode("the hot experts were cached on the device, " * 4)
    prompts = [opening + engine.tokenizer.encode(" first"), opening + engine.tokenizer.encode(" second")]
    params = SamplingParams(temperature=0, max_tokens=6)

    async def run(handle) -> tuple[str, Finished]:  # type: ignore[no-untyped-def]
        events = [event async for event in handle]
        return "".join(e.text for e in events if isinstance(e, Delta)), events[-1]

    async def main() -> list[tuple[str, Finished]]:
        running = scheduler.submit(GenerationRequest(prompts[0], SamplingParams(temperature=0, max_tokens=30)))
        await running.events.get()  # its prompt is computed and its blocks published
        late = await run(scheduler.submit(GenerationRequest(prompts[1], params)))
        running.cancel()
        return [late]

    scheduler.start()
    try:
        ((text, finished),) = asyncio.run(main())
    finally:
        scheduler.stop()
        engine.close()
    block = engine.settings.kv_block
    assert finished.timings.cache_n >= block and finished.timings.cache_n % block == 0
    assert finished.timings.cache_n + finished.timings.prompt_n == len(prompts[1])
    assert text == "".join(reference.stream(prompts[1], params))


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device, graphs", [("cpu", True), pytest.param("cuda:0", True, marks=_CUDA),
                                            pytest.param("cuda:0", False, marks=_CUDA)])
def test_overlapped_windows_on_the_real_engine_equal_windows_one_at_a_time(model_path: Path, device: str,
                                                                           graphs: bool) -> None:
    """On the real engine windows fed from the device (their sessions hold ``UNSET`` until the token is
    settled) give the greedy and seeded text of windows one at a time, and leave no ``UNSET`` behind (on
    CUDA with the decode graphs, whose inputs take the fed tokens by a device copy, and without them)."""
    from strata_core.runtime.session import UNSET
    from strata_core.serving.requests import Delta, GenerationRequest
    from strata_core.serving.scheduler import Scheduler

    texts = {}
    for overlap in (False, True):
        engine = Engine.load(model_path, devices=[device], max_context=CONTEXT, cuda_graphs=graphs)
        scheduler = Scheduler(engine, parallel=3, max_queue=8, conv_cache=2, conv_cache_bytes=1 << 24,
                              step_tokens=64, overlap=overlap)
        prompts = [engine.tokenizer.encode(f"The {word} experts were cached") for word in ("hot", "cold", "warm", "odd")]
        params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.9, seed=3, max_tokens=20),
                  SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0.7, seed=5, max_tokens=9)]

        async def text(handle) -> str:  # type: ignore[no-untyped-def]
            return "".join([event.text async for event in handle if isinstance(event, Delta)])

        async def main() -> list[str]:
            return await asyncio.gather(*(text(scheduler.submit(GenerationRequest(p, sp)))
                                          for p, sp in zip(prompts, params)))

        scheduler.start()
        try:
            texts[overlap] = asyncio.run(main())
            sessions = [slot.session for slot in scheduler._slots.idle() if slot.session is not None]
        finally:
            scheduler.stop()
            engine.close()
        assert sessions and all(UNSET not in s.tokens for s in sessions)
    assert texts[True] == texts[False]


def test_warming_up_the_prompt_path_leaves_no_counts_and_no_held_blocks(model_path: Path) -> None:
    """A server's start runs throw-away prompts: afterwards the expert counters are zero and every KV
    block is free again (its prompts published nothing that stays)."""
    engine = Engine.load(model_path, max_context=CONTEXT)
    try:
        free = [engine.kv_pools.pools[slot].n_free for slot in engine.kv_pools.pools]
        engine.warm_up_prompts()
        counts = engine.telemetry.snapshot()
        assert counts["expert_hits"] == counts["expert_misses"] == 0
        assert [engine.kv_pools.pools[slot].n_free for slot in engine.kv_pools.pools] == free
    finally:
        engine.close()
