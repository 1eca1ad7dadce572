"""Sampling: greedy, seeds, the allowed sets of top-k/top-p/min-p, llama.cpp's penalties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from strata_core.errors import RequestError
from strata_core.serving.sampling import Sampler, SamplingParams

logit_rows = arrays("float32", st.integers(2, 64), elements=st.floats(-20, 20, width=32)).map(torch.from_numpy)


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=0, seed=None))
    assert {sampler.sample(logits) for _ in range(20)} == {1}
    assert sampler.sample(torch.stack([logits, -logits]), [[], []]) == [1, 2]


def test_seed_reproducible_and_seeds_differ() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(logits) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = torch.tensor([sampler.sample(probs.log()) for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, k=st.integers(1, 70), seed=st.integers(0, 2**32))
def test_top_k_picks_only_the_k_largest(logits: torch.Tensor, k: int, seed: int) -> None:
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=k, seed=seed))
    kth = torch.sort(logits, descending=True).values[min(k, len(logits)) - 1]
    assert int(sampler.allowed(logits).sum()) == min(k, len(logits))
    for _ in range(5):
        assert logits[sampler.sample(logits)] >= kth


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, top_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**32))
def test_top_p_picks_only_from_the_nucleus(logits: torch.Tensor, top_p: float, seed: int) -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=seed))
    probs = torch.softmax(logits.double(), dim=-1)
    keep = sampler.allowed(logits)
    # Every kept token is needed: the mass strictly more likely than it is below top_p (with float slack).
    for i in torch.nonzero(keep).flatten().tolist():
        assert probs[probs > probs[i]].sum() < top_p + 1e-5
    assert probs[keep].sum() >= top_p - 1e-5
    for _ in range(5):
        assert keep[sampler.sample(logits)]


@settings(max_examples=150, deadline=None)
@given(logits=logit_rows, min_p=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
def test_min_p_picks_only_likely_enough_tokens(logits: torch.Tensor, min_p: float, seed: int) -> None:
    sampler = Sampler(SamplingParams(temperature=2.0, min_p=min_p, seed=seed))
    probs = torch.softmax(logits.double(), dim=-1)
    for _ in range(5):
        assert probs[sampler.sample(logits)] >= min_p * probs.max() * (1 - 1e-5)


def test_repetition_penalty_llama_cpp_way() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0, 4.0])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, repeat_last_n=3))
    out = sampler.penalize(logits, [4, 0, 1, 0])  # only the last 3 count: 0, 1, 0
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0, 4.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.0, 4.0]  # input untouched


def test_frequency_and_presence_penalties() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0))
    out = sampler.penalize(torch.zeros(3), [2, 2, 2, 0])
    assert out.tolist() == [-1.5, 0.0, -2.5]


def test_greedy_applies_penalties() -> None:
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=4.0))
    assert sampler.sample(torch.tensor([2.0, 1.0]), [0]) == 1


def test_logprobs_of_the_raw_distribution() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    result = Sampler(SamplingParams(temperature=0, logprobs=2)).sample_result(logits)
    logp = torch.log_softmax(logits, dim=-1)
    assert result.token == 1
    assert result.logprob == pytest.approx(float(logp[1]))
    assert [t for t, _ in result.top_logprobs] == [1, 2]
    assert result.top_logprobs[1][1] == pytest.approx(float(logp[2]))
    assert Sampler(SamplingParams(temperature=0)).sample_result(logits).logprob is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("stop", ("",)),
        ("logprobs", -1),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_stop_accepts_a_string_or_list() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
