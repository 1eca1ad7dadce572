"""gpu1_experts on logical devices: single's logits bit for bit with the union of the tiers, static
tiers next in rank after the primary's, read across (never computed there)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.plugin import ConfigError
from strata_core.testing.residency import check_tiers, single_holds

PROMPT = list(range(5, 41))
CHECKS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


@pytest.fixture(scope="module")
def reference(model):
    """single's logits of PROMPT and of a decode window after it, and its greedy continuation."""
    single = Engine.load(model, max_context=128, expert_cache=0)
    return single.logits(PROMPT), _window(single), single.generate(PROMPT, max_tokens=6, temperature=0)


def _window(engine: Engine) -> torch.Tensor:
    session = engine.new_session()
    token = int(engine.prefill(session, PROMPT).argmax())
    return engine.decode_window([(session, token)])


def _engine(model, devices: int, **settings_) -> Engine:
    options = {k: settings_.pop(k) for k in list(settings_) if k.startswith("slots_")}
    return Engine.load(model, strategy="gpu1_experts", devices=["cpu"] * devices, max_context=128, arena="pinned",
                       strategy_options=options, **settings_)


@CHECKS
@given(primary=st.integers(0, 12), others=st.lists(st.integers(1, 8), min_size=1, max_size=3),
       chunk=st.integers(4, 40), gather=st.booleans())
def test_logits_equal_single_holding_the_union(model, reference, primary, others, chunk, gather):
    engine = _engine(model, 1 + len(others), expert_cache=primary, prefill_chunk=chunk,
                     **{f"slots_device{i}": n for i, n in enumerate(others, 1)})
    engine.experts.use_gather(gather)
    assert torch.equal(engine.logits(PROMPT), reference[0])
    assert torch.equal(_window(engine), reference[1])
    held = [set(engine.experts.tables[i].resident()) for i in range(1 + len(others))]
    assert sum(map(len, held)) == len(set().union(*held))  # disjoint
    assert set().union(*held) == single_holds(model, primary + sum(others))  # the next in rank
    by_device = engine.telemetry.by_device()
    assert set(by_device) == {"cpu#0"}  # the primary computes every row


def test_greedy_equals_single_and_the_tiers_stay_static(model, reference):
    engine = _engine(model, 2, expert_cache=3, slots_device1=6, adapt_swaps=2)
    before = set(engine.experts.tables[1].resident())
    assert engine.generate(PROMPT, max_tokens=6, temperature=0) == reference[2]
    assert set(engine.experts.tables[1].resident()) == before
    assert engine.telemetry.by_device()["cpu#0"]["peer"] > 0
    check_tiers(engine)


def test_device_counts_are_checked(model):
    with pytest.raises(ConfigError, match="gpu1_experts: --devices names the primary and one to three more"):
        _engine(model, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_greedy_equals_single(model):
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    options = dict(max_context=128, dtype="float32", arena="pinned")
    want = Engine.load(model, devices=devices[:1], expert_cache=10, **options)
    engine = Engine.load(model, strategy="gpu1_experts", devices=devices, expert_cache=4,
                         strategy_options={"slots_device1": 6}, **options)
    prompt = list(range(5, 90))
    assert engine.generate(prompt, max_tokens=8, temperature=0) == want.generate(prompt, max_tokens=8, temperature=0)
