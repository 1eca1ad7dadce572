"""N-gram speculative decoding (strata_core/serving/speculation.py): prompt lookup drafts, and output
with speculation identical to output without it, greedy and seeded sampled, through the scheduler on
the real engine for every architecture (qwen3moe, gpt-oss, deepseek2, and qwen3next, whose Gated DeltaNet
state is put back to the last token kept), with fewer windows on a reply that repeats its prompt; and the kept drafts' distribution: a statistical
test of the first verified token against the target distribution."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_server_support import VOCAB, FakeEngine, serve_together

from strata_core.engine import Engine
from strata_core.serving.requests import Delta, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler
from strata_core.serving.speculation import (FIRST_PAUSE, LONGEST_PAUSE, MAX_NGRAM, MISSES_BEFORE_PAUSE, DraftPacer,
                                             NgramDrafter, accepted)

DATA = Path(__file__).parent / "data"
DEMO = Path(__file__).parent.parent / "strata_core" / "data" / "demo-qwen3moe-q8_0.gguf"
MODELS = [DEMO, DATA / "gpt-oss_llamacpp" / "model-q8_0.gguf", DATA / "deepseek3_llamacpp" / "model-q8_0.gguf",
          DATA / "qwen3next_llamacpp" / "model-q8_0.gguf"]


def _lookup(tokens: list[int], k: int) -> list[int]:
    """The draft by a plain scan: the longest suffix (up to MAX_NGRAM) seen before, latest occurrence; the
    ``k`` tokens after it, copied one at a time onto the sequence (so a copy that reaches the end goes
    on with what it copied)."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                out = list(tokens)
                for j in range(k):
                    out.append(out[start + n + j])
                return out[len(tokens):]
    return []


@settings(max_examples=300)
@given(tokens=st.lists(st.integers(0, 5), max_size=40), cut=st.integers(0, 40), k=st.integers(1, 12))
def test_the_drafter_finds_what_a_scan_finds(tokens: list[int], cut: int, k: int) -> None:
    drafter = NgramDrafter(tokens[:cut])
    drafter.extend(tokens[cut:])
    assert drafter.draft(k) == _lookup(tokens, k)


@settings(max_examples=200)
@given(loop=st.lists(st.integers(0, 1000), min_size=1, max_size=6, unique=True),
       head=st.lists(st.integers(1001, 2000), max_size=10), laps=st.integers(2, 4), into=st.integers(0, 5),
       k=st.integers(1, 16))
def test_a_loop_is_drafted_around_in_full(loop: list[int], head: list[int], laps: int, into: int, k: int) -> None:
    """A sequence that ends in a loop (``laps`` turns of ``loop``, then ``into`` of its tokens): ``k``
    drafted tokens, the loop going on, however short its period."""
    tokens = head + loop * laps + loop[:into % len(loop)]
    drafter = NgramDrafter(tokens)
    assert drafter.draft(k) == [loop[(len(tokens) - len(head) + j) % len(loop)] for j in range(k)]


@settings(max_examples=200)
@given(tokens=st.lists(st.integers(0, 5), max_size=40), k=st.integers(1, 12))
def test_a_match_k_or_more_tokens_back_drafts_what_followed_it(tokens: list[int], k: int) -> None:
    """No overlap with the end: the ``k`` tokens that followed the match, as before loops were drafted."""
    draft = NgramDrafter(tokens).draft(k)
    for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            after = starts[-1] + n
            if len(tokens) - after >= k:
                assert draft == tokens[after:after + k]
            assert len(draft) == k
            return
    assert draft == []


def test_drafts_examples() -> None:
    """A run of spaces (period 1), a repeated pair (period 2) and a plain copy."""
    assert NgramDrafter([7, 0, 0, 0]).draft(4) == [0, 0, 0, 0]
    assert NgramDrafter([5, 1, 2, 1, 2]).draft(5) == [1, 2, 1, 2, 1]
    assert NgramDrafter([1, 2, 3, 4, 5, 6, 9, 1, 2]).draft(3) == [3, 4, 5]
    assert NgramDrafter([1, 2, 3]).draft(3) == []


def test_accepted_counts_the_drafts_greedy_decoding_keeps() -> None:
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted([5, 6], [4, 6, 1]) == 0
    assert accepted([5, 6], [5, 6, 2]) == 2




CASES = [pytest.param(path, {}, id=path.parent.name if path.parent.name != "data" else "qwen3moe") for path in MODELS]
# on CUDA a window's kernels depend on its rows (a 5-row window takes the q8 MoE design, a 1-row one the
# split design): identity holds under --batch-invariant
CASES += [pytest.param(path, dict(devices=["cuda:0"], batch_invariant=True), id=f"{name}-cuda-invariant",
                       marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
          for path, name in zip(MODELS, ("qwen3moe", "gpt-oss", "deepseek2", "qwen3next"))]


@pytest.mark.parametrize("path, options", CASES)
def test_greedy_output_with_speculation_is_the_output_without(path: Path, options: dict) -> None:
    """Greedy and seeded sampled requests (replies that repeat their prompt, others, with penalties,
    top-k / top-p / min-p) give the same text with ``--spec ngram`` as without (each draft row drawn at
    the step the request's draw there takes), the drafts verified in fewer windows."""
    engine = Engine.load(path, max_context=256, **options)
    try:
        tok = engine.tokenizer
        loop = tok.encode("one two three four five six seven eight nine ten " * 4)
        requests = [GenerationRequest(loop, SamplingParams(temperature=0, max_tokens=40)),
                    GenerationRequest(tok.encode("And the king said"), SamplingParams(temperature=0, max_tokens=24)),
                    GenerationRequest(tok.encode("a b a b a b a"), SamplingParams(temperature=0, max_tokens=16,
                                                                                  stop=("zz",))),
                    GenerationRequest(tok.encode("Sampled beside"), SamplingParams(temperature=0.8, seed=2,
                                                                                   max_tokens=12)),
                    GenerationRequest(loop, SamplingParams(temperature=0.7, seed=9, top_k=20, top_p=0.9, max_tokens=30)),
                    GenerationRequest(loop, SamplingParams(temperature=1.0, seed=4, min_p=0.05, max_tokens=30,
                                                           frequency_penalty=0.3)),
                    GenerationRequest(loop, SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3,
                                                           presence_penalty=0.5))]
        plain, without = serve_together(engine, requests)
        spec, with_spec = serve_together(engine, requests, 4)
    finally:
        engine.close()
    assert spec == plain
    assert with_spec.stats.draft_tokens > 0 and with_spec.stats.windows <= without.stats.windows
    assert with_spec.stats.completion_tokens == without.stats.completion_tokens


@pytest.mark.parametrize("path", [pytest.param(p, id=p.parent.name if p.parent.name != "data" else "qwen3moe")
                                  for p in MODELS])
def test_a_window_of_one_session_s_rows_gives_each_row_its_prefill_logits(path: Path) -> None:
    """A verification window (several rows of one session) crossing the CPU attention's key blocks
    (``ATTN_BLOCK``, 256 positions): each row attends over every position up to its own, so its logits are
    those a prefill of the same tokens gives at that position."""
    engine = Engine.load(path, max_context=320, devices=["cpu"])
    try:
        tokens = torch.randint(10, 200, (262,), generator=torch.Generator().manual_seed(3)).tolist()
        want = engine.logits(tokens)  # [T, V]
        for start, rows in ((250, 9), (253, 5)):
            session = engine.new_session()
            engine.prefill(session, tokens[:start])
            got = engine.decode_window([(session, t) for t in tokens[start:start + rows]]).float()
            engine.release_session(session)
            torch.testing.assert_close(got, want[start:start + rows].float(), rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def test_a_request_s_timings_count_its_drafts() -> None:
    """llama-server's ``draft_n`` / ``draft_n_accepted`` in a request's timings, and its log line."""
    engine = Engine.load(DEMO, max_context=256)
    scheduler = Scheduler(engine, parallel=1, max_queue=1, conv_cache=0, conv_cache_bytes=0, step_tokens=256,
                          spec_tokens=3)
    prompt = engine.tokenizer.encode("one two three four five six seven eight nine ten " * 4)

    async def main():  # type: ignore[no-untyped-def]
        return [event async for event in scheduler.submit(GenerationRequest(prompt, SamplingParams(temperature=0,
                                                                                                   max_tokens=30)))]

    scheduler.start()
    try:
        end = asyncio.run(main())[-1]
    finally:
        scheduler.stop()
        engine.close()
    timings = end.timings.to_dict()
    assert timings["draft_n"] == scheduler.stats.draft_tokens > 0
    assert timings["draft_n_accepted"] == scheduler.stats.accepted_tokens
    assert f"drafts kept {timings['draft_n_accepted']}/{timings['draft_n']}" in end.timings.summary()


def test_spec_ngram_on_the_server(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """``--spec ngram`` through the server's settings: the completion is greedy decoding's, and /metrics
    counts the drafts and the tokens a window."""
    import httpx
    from test_server_support import live_server

    from strata_core.config import StrataSettings

    texts, metrics = {}, ""
    prompt = "one two three four five six seven eight nine ten " * 3
    for spec in ("off", "ngram"):
        settings = StrataSettings(model=DEMO, model_alias="demo", max_context=256, spec=spec, spec_tokens=3)
        with live_server(settings) as url:
            body = {"model": "demo", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            texts[spec] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            metrics = httpx.get(f"{url}/metrics").text
    assert texts["ngram"] == texts["off"]
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("strata_")}
    assert values["strata_spec_draft_tokens_total"] > 0 and values["strata_tokens_per_window"] > 1


class _Fixed(FakeEngine):
    """Every position's logits the same: four candidate tokens (10-13) of known probabilities."""

    LOGITS = torch.full((VOCAB,), -40.0)
    LOGITS[10:14] = torch.tensor([0.0, 0.5, 1.0, 1.5])

    def next_logits(self, session):  # type: ignore[no-untyped-def]
        return self.LOGITS.clone()


def test_kept_drafts_follow_the_target_distribution() -> None:
    """Sampled with drafts (a prompt whose tokens repeat, so lookup drafts them), the tokens of the
    positions the drafts cover follow the target distribution: a chi-square over 1,200 seeded requests
    within its 0.999 quantile (3 degrees of freedom: 16.27); drafts were kept and rejected both."""
    engine = _Fixed(max_context=64)
    n = 1200
    scheduler = Scheduler(engine, parallel=8, max_queue=n, conv_cache=0, conv_cache_bytes=0, step_tokens=64,
                          spec_tokens=3)
    prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]

    async def tokens(seed: int) -> list[int]:
        handle = scheduler.submit(GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=4)))
        return [t for event in [e async for e in handle] if isinstance(event, Delta) for t in event.tokens]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(tokens(seed) for seed in range(n)))

    scheduler.start()
    try:
        out = asyncio.run(main())
    finally:
        scheduler.stop()
    assert scheduler.stats.accepted_tokens > 0 and scheduler.stats.accepted_tokens < scheduler.stats.draft_tokens
    p = torch.softmax(_Fixed.LOGITS[10:14].double(), 0)
    for position in (1, 2, 3):  # the tokens a speculative window gives
        counts = torch.bincount(torch.tensor([t[position] - 10 for t in out]), minlength=4).double()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 16.27, (position, counts.tolist(), (n * p).tolist())


def test_a_pacer_pauses_drafts_that_miss_longer_each_time_until_one_is_kept() -> None:
    """``MISSES_BEFORE_PAUSE`` windows that keep nothing start a pause of ``FIRST_PAUSE`` windows; each probe
    after a pause that keeps nothing doubles it up to ``LONGEST_PAUSE``; a kept draft ends the pauses, and
    windows without drafts (none found) count for nothing."""
    pacer, pauses = DraftPacer(), []
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        assert pacer.drafts_now()
        pacer.record(3, 0)
        pacer.record(0, 0)
    for _ in range(7):
        assert pacer.drafts_now()
        pacer.record(3, 0)  # the last miss before a pause, then each probe
        skipped = 0
        while not pacer.drafts_now():
            skipped += 1
        pauses.append(skipped)
    assert pauses == [min(LONGEST_PAUSE, FIRST_PAUSE * 2 ** i) for i in range(7)]
    pacer.record(3, 1)
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        pacer.record(3, 0)
        assert pacer.drafts_now()
    pacer.record(3, 0)
    assert sum(not pacer.drafts_now() for _ in range(FIRST_PAUSE + 1)) == FIRST_PAUSE


class _WrongDrafter:
    """Drafts a token greedy decoding of ``_Tens`` never picks."""

    def __init__(self, tokens=()) -> None:  # type: ignore[no-untyped-def]
        pass

    def extend(self, tokens) -> None:  # type: ignore[no-untyped-def]
        pass

    def draft(self, k: int) -> list[int]:
        return [11] * k


class _Tens(FakeEngine):
    """Every position's greedy token is 10."""

    def next_logits(self, session):  # type: ignore[no-untyped-def]
        logits = torch.full((VOCAB,), -40.0)
        logits[10] = 0.0
        return logits


def test_drafts_that_always_miss_are_paused_and_the_text_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose every draft is rejected drafts in a few of its windows only (the pacer's pauses), and
    its text is the one without drafts."""
    from strata_core.serving import windows

    monkeypatch.setattr(windows, "NgramDrafter", _WrongDrafter)
    requests = [GenerationRequest([10, 11, 12], SamplingParams(temperature=0, max_tokens=200))]
    plain, _ = serve_together(_Tens(max_context=256), requests)
    spec, scheduler = serve_together(_Tens(max_context=256), requests, 3)
    assert spec == plain
    stats = scheduler.stats
    assert stats.accepted_tokens == 0 and 0 < stats.draft_tokens <= 3 * 12  # 4 misses and a probe a pause
    assert stats.paused_windows > 150 and stats.windows == 199  # the first token is the prompt pass's
