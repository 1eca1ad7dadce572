"""Sampling: greedy, seeds, the allowed sets of top-k/top-p/min-p, llama.cpp's penalties, the batched
sampler against a direct reference, its distribution, and its counter-based RNG's batch invariance."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from strata_core.errors import RequestError
from strata_core.serving.sampling import (
    Sampler,
    SamplingParams,
    sample_rows,
    uniform,
)

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


# --- the batched sampler against a direct reference ---------------------------------------------

# few distinct values, so ties (and llama.cpp's tie rule) are common
tied_rows = arrays("float32", st.integers(2, 48), elements=st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 2.5])).map(
    torch.from_numpy)


def ref_order(logits: torch.Tensor) -> list[int]:
    """Descending by logit, ties by the lower id (llama.cpp's order), in plain Python."""
    return sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))


def ref_penalize(logits: torch.Tensor, history: list[int], p: SamplingParams) -> list[float]:
    out = [float(v) for v in logits]
    for i, b in p.logit_bias:
        out[i] += b
    recent = history[-p.repeat_last_n:] if p.repeat_last_n else []
    for t, n in Counter(recent).items():
        v = out[t]
        v = v * p.repetition_penalty if v <= 0 else v / p.repetition_penalty
        out[t] = v - n * p.frequency_penalty - p.presence_penalty
    return out


def ref_allowed(logits: list[float], p: SamplingParams) -> tuple[set[int], set[int]]:
    """The kept set (float64, plain Python), and the tokens whose fate sits within float slack of a
    top-p or min-p boundary (either answer is right for them)."""
    order = ref_order(torch.tensor(logits, dtype=torch.float64))
    kept = order[: p.top_k] if p.top_k else order
    top = logits[order[0]]
    w = {i: math.exp(logits[i] - top) for i in kept}
    total = sum(w.values())
    edge, out, before = set(), [], 0.0
    for rank, i in enumerate(kept):
        if rank == 0 or before / total < p.top_p:
            out.append(i)
        if rank and abs(before / total - p.top_p) < 1e-6:
            edge.add(i)
        before += w[i]
    final = set()
    for i in out:
        ratio = math.exp(logits[i] - top)
        if ratio >= p.min_p:
            final.add(i)
        if abs(ratio - p.min_p) < 1e-6:
            edge.add(i)
    return final, edge


def ref_probs(logits: list[float], p: SamplingParams) -> dict[int, float]:
    keep, _ = ref_allowed(logits, p)
    top = max(logits[i] for i in keep)
    w = {i: math.exp((logits[i] - top) / p.temperature) for i in keep}
    total = sum(w.values())
    return {i: v / total for i, v in w.items()}


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 2, 5, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.4]),
    repeat_last_n=st.sampled_from([0, 3, 64]),
    seed=st.integers(-(2**63), 2**64 - 1),
)


@settings(max_examples=200, deadline=None)
@given(logits=st.one_of(logit_rows, tied_rows), k=st.integers(1, 70))
def test_top_k_keeps_the_k_first_in_llama_cpp_order(logits: torch.Tensor, k: int) -> None:
    keep = Sampler(SamplingParams(top_k=k)).allowed(logits)
    assert set(torch.nonzero(keep).flatten().tolist()) == set(ref_order(logits)[:k])


@settings(max_examples=200, deadline=None)
@given(logits=st.one_of(logit_rows, tied_rows), params=params_st)
def test_allowed_set_matches_the_reference(logits: torch.Tensor, params: SamplingParams) -> None:
    got = set(torch.nonzero(Sampler(params).allowed(logits)).flatten().tolist())
    want, edge = ref_allowed(logits.tolist(), params)
    assert got ^ want <= edge


@settings(max_examples=150, deadline=None)
@given(logits=st.one_of(logit_rows, tied_rows), params=params_st, data=st.data())
def test_penalties_and_bias_match_the_reference(logits: torch.Tensor, params: SamplingParams, data: st.DataObject) -> None:
    v = len(logits)
    history = data.draw(st.lists(st.integers(0, v - 1), max_size=80))
    bias = data.draw(st.lists(st.tuples(st.integers(0, v - 1), st.floats(-5, 5)), max_size=4, unique_by=lambda b: b[0]))
    params = SamplingParams(**{**params.__dict__, "logit_bias": tuple(bias)})
    got = Sampler(params).penalize(logits, history)
    assert got.tolist() == pytest.approx(ref_penalize(logits, history, params), rel=1e-6, abs=1e-5)


@settings(max_examples=150, deadline=None)
@given(logits=st.one_of(logit_rows, tied_rows), params=params_st, data=st.data())
def test_batched_rows_obey_their_own_params(logits: torch.Tensor, params: SamplingParams, data: st.DataObject) -> None:
    """A window of rows with mixed parameters: greedy rows take the argmax (lowest id on ties) of
    the penalised logits, sampled rows a token of their kept set."""
    v, n = len(logits), data.draw(st.integers(1, 5))
    rows = [logits[torch.randperm(v, generator=torch.Generator().manual_seed(i))] for i in range(n)]
    plist = [params] + [data.draw(params_st) for _ in range(n - 1)]
    hists = [data.draw(st.lists(st.integers(0, v - 1), max_size=10)) for _ in range(n)]
    results = sample_rows(torch.stack(rows), [(Sampler(p), h) for p, h in zip(plist, hists)])
    for row, p, h, result in zip(rows, plist, hists, results):
        x = ref_penalize(row, h, p)
        if p.greedy:
            assert result.token == ref_order(torch.tensor(x))[0]
        else:
            keep, edge = ref_allowed(x, p)
            assert result.token in keep | edge


# --- the distribution -----------------------------------------------------------------------------

def chi_square_p_value(counts: dict[int, int], probs: dict[int, float]) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"drew tokens outside the kept set: {set(counts) - set(probs)}"
    stat = sum((counts.get(i, 0) - n * q) ** 2 / (n * q) for i, q in probs.items())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


DIST_LOGITS = torch.tensor([2.0, 1.5, 1.5, 0.7, 0.0, -0.5, -1.0, 1.9, -4.0, 0.3])
N_DRAWS = 8000
DIST_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.8, min_p=0.2),
    SamplingParams(temperature=1.7, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", DIST_PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_over_seeds_follow_the_tempered_filtered_softmax(params: SamplingParams) -> None:
    """The first token of 8,000 seeds (0..7999, fixed: the test is deterministic) against the exact
    distribution; a chi-square p-value below 1e-3 fails. A wrong temperature, a wrong kept set or
    a biased RNG shows up at this size (moving 1% of the mass from one token to another fails)."""
    probs = ref_probs(DIST_LOGITS.tolist(), params)
    batch = DIST_LOGITS.expand(N_DRAWS, -1)
    rows = [(Sampler(SamplingParams(**{**params.__dict__, "seed": s})), ()) for s in range(N_DRAWS)]
    counts = Counter(r.token for r in sample_rows(batch, rows))
    assert chi_square_p_value(counts, probs) > 1e-3


def test_draws_over_steps_follow_the_distribution() -> None:
    """One seed, 4,000 successive steps on the same logits."""
    params = SamplingParams(temperature=0.9, top_k=8, seed=12345)
    sampler = Sampler(params)
    counts = Counter(sampler.sample(DIST_LOGITS) for _ in range(4000))
    assert chi_square_p_value(counts, ref_probs(DIST_LOGITS.tolist(), params)) > 1e-3


def test_a_wrong_distribution_fails_the_check() -> None:
    """The bound can fail: draws at temperature 1 judged against temperature 1.1's probabilities,
    or against them with 1% of the mass moved from the top token to another."""
    rows = [(Sampler(SamplingParams(temperature=1.0, seed=s)), ()) for s in range(N_DRAWS)]
    counts = Counter(r.token for r in sample_rows(DIST_LOGITS.expand(N_DRAWS, -1), rows))
    exact = ref_probs(DIST_LOGITS.tolist(), SamplingParams(temperature=1.0))
    assert chi_square_p_value(counts, exact) > 1e-3
    assert chi_square_p_value(counts, ref_probs(DIST_LOGITS.tolist(), SamplingParams(temperature=1.1))) < 1e-3
    shifted = {**exact, 0: exact[0] - 0.01, 4: exact[4] + 0.01}
    assert chi_square_p_value(counts, shifted) < 1e-3


def test_the_uniforms_are_uniform_and_independent_of_the_step() -> None:
    seeds = range(0, 2**64, 2**64 // 20000)
    u0 = torch.tensor([uniform(seed, 0) for seed in seeds], dtype=torch.float64)
    u1 = torch.tensor([uniform(seed, 1) for seed in seeds], dtype=torch.float64)
    assert float(u0.min()) >= 0 and float(u0.max()) < 1
    grid = torch.linspace(0, 1, 101, dtype=torch.float64)
    ks = ((u0[:, None] <= grid).double().mean(0) - grid).abs().max()
    assert ks < 1.63 / math.sqrt(len(u0))  # Kolmogorov-Smirnov at 1%
    assert abs(float(torch.corrcoef(torch.stack([u0, u1]))[0, 1])) < 0.03
    assert len(set(u0.tolist())) == len(u0)


# --- seeds and batch invariance ------------------------------------------------------------------

def _generate(rows: list[tuple[SamplingParams, torch.Tensor]], steps: int) -> list[list[int]]:
    """Each row's tokens over ``steps`` windows, all rows sampled together; the logits of a row at
    a step are its base logits shifted by its own previous token (a stand-in for a model)."""
    samplers = [Sampler(p) for p, _ in rows]
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        logits = torch.stack([base.roll(out[i][-1] if out[i] else 0) for i, (_, base) in enumerate(rows)])
        for i, result in enumerate(sample_rows(logits, [(s, h) for s, h in zip(samplers, out)])):
            out[i].append(result.token)
    return out


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 3000
    mine = (SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=42), torch.randn(vocab, generator=g) * 3)
    plain = (SamplingParams(temperature=1.1, seed=-7), torch.randn(vocab, generator=g) * 3)
    others = [
        (SamplingParams(temperature=0), torch.randn(vocab, generator=g)),
        (SamplingParams(temperature=1.0, top_k=400, seed=3, logprobs=3), torch.randn(vocab, generator=g)),
        (SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, seed=2**64 - 1), torch.randn(vocab, generator=g)),
        (SamplingParams(temperature=1.0, top_k=5, frequency_penalty=1.0, logit_bias=((3, 9.0),), seed=9),
         torch.randn(vocab, generator=g)),
    ]
    alone = _generate([mine], 30)[0]
    plain_alone = _generate([plain], 30)[0]
    for batch in ([mine, plain], [plain, *others, mine], [*others[:2], mine, *others[2:], plain]):
        got = _generate(batch, 30)
        assert got[batch.index(mine)] == alone
        assert got[batch.index(plain)] == plain_alone
    assert len(set(alone)) > 5  # it did sample


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    base = torch.randn(2000, generator=torch.Generator().manual_seed(5)) * 2
    runs = {s: _generate([(SamplingParams(temperature=1.0, top_p=0.95, seed=s), base)], 40)[0] for s in (0, 1, 2, 0)}
    assert _generate([(SamplingParams(temperature=1.0, top_p=0.95, seed=0), base)], 40)[0] == runs[0]
    assert len({tuple(r) for r in runs.values()}) == 3
    unseeded = [_generate([(SamplingParams(temperature=1.0), base)], 20)[0] for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # a fresh seed each time


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = torch.randn(3, 50)
    logits[1, 7] = math.nan
    out = sample_rows(logits, [(Sampler(SamplingParams(temperature=1.0, seed=1)), ()),
                               (Sampler(SamplingParams(temperature=1.0, seed=1)), ()),
                               (Sampler(SamplingParams(temperature=0)), ())])
    assert isinstance(out[1], FloatingPointError)
    assert not isinstance(out[0], Exception) and out[2].token == int(logits[2].argmax())


def test_logprobs_per_row_in_a_batch() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    samplers = [Sampler(SamplingParams(temperature=0, logprobs=4)), Sampler(SamplingParams(temperature=1.0, seed=1)),
                Sampler(SamplingParams(temperature=1.0, seed=1, logprobs=0))]
    out = sample_rows(logits, [(s, ()) for s in samplers])
    logp = torch.log_softmax(logits.double(), dim=-1)
    assert out[0].logprob == pytest.approx(float(logp[0].max()), abs=1e-5)
    assert [t for t, _ in out[0].top_logprobs] == torch.topk(logp[0], 4).indices.tolist()
    assert out[1].logprob is None and out[1].top_logprobs == ()
    assert out[2].logprob == pytest.approx(float(logp[2, out[2].token]), abs=1e-5) and out[2].top_logprobs == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_cpu_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 152064, generator=g) * 4
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, logprobs=5),
              SamplingParams(temperature=0.7, min_p=0.1, seed=4), SamplingParams(temperature=1.2, top_k=1000, seed=5)]
    history = [random.Random(i).choices(range(152064), k=64) for i in range(6)]
    for _ in range(3):
        cpu = sample_rows(logits, [(Sampler(p), h) for p, h in zip(params, history)])
        gpu = sample_rows(logits.cuda(), [(Sampler(p), h) for p, h in zip(params, history)])
        assert [r.token for r in cpu] == [r.token for r in gpu]
        assert cpu[3].top_logprobs[0][0] == gpu[3].top_logprobs[0][0]
        logits = logits.roll(1, dims=1)
