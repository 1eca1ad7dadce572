"""Logits are bit-identical on the CPU whatever the expert cache holds, however misses are served,
with or without adaptation, and whatever the prompt chunk size (prefill and decode windows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine

PROMPT = list(range(7, 30))
DECODE = [40, 41, 42, 43]


def run(engine: Engine) -> torch.Tensor:
    """Prompt logits followed by the logits of a few decode windows."""
    session = engine.new_session()
    rows = [engine.prefill(session, PROMPT, all_logits=True)]
    for token in DECODE:
        rows.append(engine.decode_window([(session, token)]))
    engine.release_session(session)
    return torch.cat(rows)


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"])
def model(request, tiny_model_factory):
    if request.param == "gpt-oss":  # sinks, a sliding window, biased swiglu_oai experts in MXFP4
        return Path(__file__).parent / "data" / "gpt-oss_llamacpp" / "model-mxfp4.gguf"
    if request.param == "qwen3next":  # Gated DeltaNet state, gated attention, a shared expert; 12 experts
        return Path(__file__).parent / "data" / "qwen3next_llamacpp" / "model-q8_0.gguf"
    if request.param == "deepseek2":  # MLA latent state, a dense layer 0, grouped sigmoid router; 16 experts
        return Path(__file__).parent / "data" / "deepseek3_llamacpp" / "model-q8_0.gguf"
    return tiny_model_factory(expert_type="Q4_0")


@pytest.fixture(scope="module")
def reference(model):
    return run(Engine.load(model, max_context=64, expert_cache=16))


@given(
    slots=st.integers(0, 16),
    pcie_frac=st.sampled_from([0.0, 0.5, 1.0]),
    adapt_swaps=st.integers(0, 3),
    chunk=st.integers(1, len(PROMPT)),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_logits_do_not_depend_on_residency(model, reference, slots, pcie_frac, adapt_swaps, chunk):
    engine = Engine.load(model, max_context=64, expert_cache=slots, pcie_frac=pcie_frac,
                         adapt_swaps=adapt_swaps, prefill_chunk=chunk)
    assert torch.equal(run(engine), reference)
    stats = engine.telemetry.snapshot()
    if slots == 0:
        assert stats["expert_hits"] == 0 and stats["expert_misses"] > 0


def test_budget_that_cannot_hold_the_dense_part_is_an_error(model):
    from strata_core.errors import BudgetError

    with pytest.raises(BudgetError, match="needs .* GiB .* available"):
        Engine.load(model, reserve_mib=10**9)
