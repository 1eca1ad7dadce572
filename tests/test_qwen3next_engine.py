"""Qwen3-Next through the engine on the CPU: its recurrent state (Gated DeltaNet conv + ssm) survives a
conversation-cache round trip, a hand-off between device slots and the topologies bit for bit, and
prefix reuse through the server only reuses what a recurrent state allows."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from test_server_support import live_server

from strata_core.config import StrataSettings
from strata_core.engine import Engine

MODEL = Path(__file__).parent / "data" / "qwen3next_llamacpp" / "model-q8_0.gguf"
PROMPT = list(range(5, 45))
CONTEXT = 128


@pytest.fixture(scope="module")
def single() -> Engine:
    return Engine.load(MODEL, max_context=CONTEXT, expert_cache=0)


@pytest.fixture(scope="module")
def reference(single):
    return single.logits(PROMPT), single.generate(PROMPT, max_tokens=6, temperature=0)


def _state(session) -> dict[tuple[int, str], torch.Tensor]:
    kv = session.kv
    return {(layer, name): t.clone() for layer in kv.layers for name, t in kv.committed(layer).items()}


def test_conversation_cache_round_trip_is_bit_identical(single, reference):
    session = single.new_session()
    single.prefill(session, PROMPT[:30])
    saved = single.save_session(session)
    restored = single.restore_session(saved)
    before = _state(session)
    assert any(name == "ssm" and t.abs().max() > 0 for (_, name), t in before.items())
    after = _state(restored)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for s in (session, restored):  # both continue exactly as the whole prompt did
        assert torch.equal(single.prefill(s, PROMPT[30:], all_logits=True), reference[0][30:])


def test_a_recurrent_state_is_not_rewound(single):
    session = single.new_session()
    single.prefill(session, PROMPT[:10])
    with pytest.raises(ValueError, match="recurrent"):
        session.truncate(5)
    session.truncate(0)
    assert all(not t.any() for (_, name), t in _state(session).items() if name in ("conv", "ssm"))


@pytest.mark.parametrize("strategy, cut", [("layer_split", 2), ("prefill_main", 1)])
def test_topologies_equal_single_bit_for_bit(reference, strategy, cut):
    """Layers 0 and 2 are Gated DeltaNet layers, 1 full attention: each cut puts a recurrent state on
    the second slot; prefill_main hands it off after every prompt segment (checked by --dbg-handoff)."""
    engine = Engine.load(MODEL, strategy=strategy, devices=["cpu", "cpu"], max_context=CONTEXT, expert_cache=2,
                         prefill_chunk=7, strategy_options={"split": str(cut)}, dbg_handoff=True)
    assert torch.equal(engine.logits(PROMPT), reference[0])
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[1]


def _settings(**kw) -> StrataSettings:
    return StrataSettings(model=MODEL, model_alias="q3n", max_context=CONTEXT, **kw)


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy token ids after ``prompt``, run alone (one fresh session, no reuse)."""
    session = engine.new_session()
    logits, out = engine.prefill(session, prompt), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode_window([(session, out[-1])])[0]
    return out


def test_server_reuses_only_whole_recurrent_prefixes(single):
    """A second turn extends the whole cached conversation: its state is reused; a prompt sharing
    only part of an idle session's tokens cannot cut the recurrent state back, so it starts afresh.
    Every answer equals the request run alone."""
    first = PROMPT[:12]
    second = first + _greedy(single, first, 4) + [7, 8, 9]
    partial = first[:8] + [99, 98, 97]
    with live_server(_settings(parallel=1, conv_cache=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answers = [client.completions.create(model="q3n", prompt=prompt, max_tokens=4, temperature=0)
                   for prompt in (first, second, partial)]
    for prompt, answer in zip((first, second, partial), answers):
        assert answer.choices[0].text == single.tokenizer.decode(_greedy(single, prompt, 4))
    assert answers[1].model_extra["timings"]["cache_n"] == len(first) + 3  # the last reply token was never fed
    # (windows do not overlap over recurrent state: Scheduler.overlap)
    assert answers[2].model_extra["timings"]["cache_n"] == 0


def test_a_failed_decode_window_is_not_retried_over_an_advanced_state(single, monkeypatch):
    """A decode window that fails after its first layers ran has advanced their recurrent state: a
    retry of each request alone (exact for K/V, which it rewrites) would advance it twice. Every
    request of such a window fails instead; none answers wrongly."""
    import asyncio

    from strata_core.serving.requests import Delta, GenerationRequest
    from strata_core.serving.sampling import SamplingParams
    from strata_core.serving.scheduler import Scheduler

    engine = single
    prompts = [PROMPT[:9], PROMPT[5:20]]
    alone = [engine.tokenizer.decode(_greedy(engine, p, 4)) for p in prompts]
    moe, failed = engine.model.moe, []

    def failing_once(layer, h, rows):  # the first two-session window fails after layer 0 ran
        if layer == 1 and h.shape[0] == 2 and not failed:
            failed.append(layer)
            raise RuntimeError("device fault")
        return moe(layer, h, rows)

    monkeypatch.setattr(engine.model, "moe", failing_once)
    scheduler = Scheduler(engine, parallel=2, max_queue=4, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=512)
    scheduler.start()

    async def one(prompt: list[int]) -> str:
        text = ""
        async for event in scheduler.submit(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=4))):
            text += event.text if isinstance(event, Delta) else ""
        return text

    async def main() -> list:
        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert failed
    for result, want in zip(results, alone):
        assert isinstance(result, Exception) or result == want
