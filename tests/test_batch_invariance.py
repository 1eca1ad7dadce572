"""On the CPU a token's logits do not depend on the prompt chunking or on the decode batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.ops.matmul import linear

PROMPT = list(range(3, 40))
#: gpt-oss (sinks, a sliding window of 4, biased swiglu_oai experts in MXFP4; tests/test_gpt_oss.py)
GPT_OSS = Path(__file__).parent / "data" / "gpt-oss_llamacpp" / "model-mxfp4.gguf"
#: Qwen3-Next (Gated DeltaNet recurrent state + gated attention; tests/test_qwen3next.py)
QWEN3NEXT = Path(__file__).parent / "data" / "qwen3next_llamacpp" / "model-q8_0.gguf"
#: deepseek2 (MLA on a latent state, a leading dense layer, grouped sigmoid router; tests/test_deepseek2.py)
DEEPSEEK2 = Path(__file__).parent / "data" / "deepseek3_llamacpp" / "model-q8_0.gguf"


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"])
def engine(request, tiny_model_factory):
    path = ({"gpt-oss": GPT_OSS, "qwen3next": QWEN3NEXT, "deepseek2": DEEPSEEK2}.get(request.param)
            or tiny_model_factory(expert_type="Q8_0"))
    return Engine.load(path, max_context=64)


@pytest.fixture(scope="module")
def reference(engine):
    return engine.logits(PROMPT)


@given(rows=st.integers(1, 70), split=st.integers(0, 70))
@settings(max_examples=30, deadline=None)
def test_linear_rows_do_not_depend_on_the_batch(rows, split):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(80, 96, generator=generator)
    split = min(split, rows)
    whole = linear(x, weight)
    parts = torch.cat([linear(x[:split], weight), linear(x[split:], weight)])
    assert torch.equal(whole, parts)


@given(chunk=st.integers(1, len(PROMPT)))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_logits_do_not_depend_on_the_chunk_size(engine, reference, chunk):
    engine.settings.prefill_chunk = chunk
    try:
        assert torch.equal(engine.logits(PROMPT), reference)
    finally:
        engine.settings.prefill_chunk = 8192


def test_decode_window_rows_do_not_depend_on_the_batch(engine, reference):
    cut = [5, 11, 20]
    sessions = [engine.new_session() for _ in cut]
    for session, n in zip(sessions, cut):
        engine.prefill(session, PROMPT[:n])
    batched = engine.decode_window([(s, PROMPT[n]) for s, n in zip(sessions, cut)])
    for row, n in zip(batched, cut):
        assert torch.equal(row, reference[n])
