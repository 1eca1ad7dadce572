"""gpt-oss through the engine on the CPU (the MXFP4 fixture of tests/test_gpt_oss.py): the topologies
give single's logits bit for bit with the sliding-window and full layers on different device slots,
and the server's conversation cache reuses a cached prefix (also one a sliding window has moved past)
with the answers of the requests run alone; a chat request is rendered in the harmony format."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from test_server_support import live_server

from strata_core.config import StrataSettings
from strata_core.engine import Engine

MODEL = Path(__file__).parent / "data" / "gpt-oss_llamacpp" / "model-mxfp4.gguf"
PROMPT = list(range(5, 45))
CONTEXT = 128


@pytest.fixture(scope="module")
def single() -> Engine:
    return Engine.load(MODEL, max_context=CONTEXT, expert_cache=0)


@pytest.fixture(scope="module")
def reference(single):
    return single.logits(PROMPT), single.generate(PROMPT, max_tokens=6, temperature=0)


@pytest.mark.parametrize("strategy", ["layer_split", "prefill_main"])
def test_topologies_equal_single_bit_for_bit(reference, strategy):
    """The cut puts the sliding-window layer 0 on the first slot and the full layer 1 on the second;
    prefill_main hands the KV off after every prompt segment (checked by --dbg-handoff)."""
    engine = Engine.load(MODEL, strategy=strategy, devices=["cpu", "cpu"], max_context=CONTEXT, expert_cache=2,
                         prefill_chunk=7, strategy_options={"split": "1"}, dbg_handoff=True)
    assert torch.equal(engine.logits(PROMPT), reference[0])
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[1]


def _settings(**kw) -> StrataSettings:  # room for the harmony system prompt in the tiny vocabulary
    return StrataSettings(model=MODEL, model_alias="oss", max_context=4 * CONTEXT, **kw)


def test_server_conversation_cache_reuses_prefixes(single):
    """A second turn extends the cached first one (its KV reused); a prompt sharing 20 tokens with
    it reuses those (positions far beyond the window of 4). Every answer equals the request alone."""
    first = PROMPT[:24]
    second = first + [7, 8, 9]
    partial = first[:20] + [99, 98, 97]
    with live_server(_settings(parallel=1, conv_cache=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answers = [client.completions.create(model="oss", prompt=prompt, max_tokens=4, temperature=0)
                   for prompt in (first, second, partial)]
        chat = client.chat.completions.create(model="oss", max_tokens=2, temperature=0,
                                              messages=[{"role": "user", "content": "the fox"}])
    for prompt, answer in zip((first, second, partial), answers):
        assert answer.choices[0].text == single.generate(prompt, max_tokens=4, temperature=0)
    assert answers[1].model_extra["timings"]["cache_n"] >= len(first)
    assert answers[2].model_extra["timings"]["cache_n"] == 20
    rendered = single.chat.render([{"role": "user", "content": "the fox"}])
    assert rendered.endswith("<|start|>user<|message|>the fox<|end|><|start|>assistant")
    assert chat.usage.prompt_tokens == len(single.tokenizer.encode(rendered))
