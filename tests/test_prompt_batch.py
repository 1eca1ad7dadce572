"""Prompt batches: several sessions' prompt chunks in one pass (Engine.prefill_batch, what a server
step runs when it starts several requests) give each chunk's logits bit for bit as the chunk alone,
on every architecture, across passes of at most ``--prefill-chunk`` tokens; the scheduler batches a
step's chunks for a rewindable model only."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch_invariance import DEEPSEEK2, GPT_OSS, QWEN3NEXT
from test_scheduler import _request, _run
from test_server_support import FakeEngine

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.model.kvpool import KVPoolFull
from strata_core.runtime.session import PromptBatch, Session
from strata_core.serving.scheduler import Scheduler

CHUNK = 8  # --prefill-chunk: batches of up to 8 tokens, a longer chunk alone in pieces of 8


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"])
def engine(request, tiny_model_factory):
    path = ({"gpt-oss": GPT_OSS, "qwen3next": QWEN3NEXT, "deepseek2": DEEPSEEK2}.get(request.param)
            or tiny_model_factory(expert_type="Q8_0"))
    return Engine.load(path, max_context=64, parallel=4, prefill_chunk=CHUNK)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@given(firsts=st.lists(st.integers(1, 12), min_size=1, max_size=4), seconds=st.lists(st.integers(1, 6), min_size=4,
                                                                                      max_size=4))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_prompt_batch_gives_each_chunk_its_logits_alone(engine, firsts, seconds):
    vocab = engine.spec.vocab_size
    prompts = [_prompt(i, a + b, vocab) for i, (a, b) in enumerate(zip(firsts, seconds))]
    want = []
    for prompt, a in zip(prompts, firsts):
        session = engine.new_session()
        want.append([engine.prefill(session, prompt[:a]), engine.prefill(session, prompt[a:]),
                     engine.decode_window([(session, 3)])[0]])
        engine.release_session(session)
    sessions = [engine.new_session() for _ in prompts]
    first = engine.prefill_batch([(s, p[:a]) for s, p, a in zip(sessions, prompts, firsts)])
    second = engine.prefill_batch([(s, p[a:]) for s, p, a in zip(sessions, prompts, firsts)])
    window = engine.decode_window([(s, 3) for s in sessions])
    for i, session in enumerate(sessions):
        assert session.n_tokens == len(prompts[i]) + 1 and session.tokens[:-1] == prompts[i]
        assert torch.equal(first[i], want[i][0]) and torch.equal(second[i], want[i][1])
        assert torch.equal(window[i], want[i][2])
        engine.release_session(session)


def test_a_batch_the_pool_cannot_hold_commits_nothing_and_gives_its_blocks_back(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=64, kv_block=4, kv_pool_tokens=64)
    a, b = engine.new_session(), engine.new_session()
    with pytest.raises(KVPoolFull, match="is full"):
        engine.prefill_batch([(a, list(range(40))), (b, list(range(30)))])  # 10 blocks, then 8 of the 6 left
    assert a.n_tokens == b.n_tokens == 0 and engine.kv_pools.used(0) == 0
    assert engine.prefill_batch([(a, list(range(40)))]).shape[0] == 1  # the pool is whole again


def test_a_batch_names_each_session_once_and_every_chunk_has_tokens():
    session = Session(kv=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        PromptBatch.of([(session, torch.tensor([1])), (session, torch.tensor([2]))])
    with pytest.raises(ValueError, match="at least one token"):
        PromptBatch.of([(session, torch.tensor([], dtype=torch.int64))])
    batch = PromptBatch.of([(session, torch.tensor([4, 5, 6])), (Session(kv=None), torch.tensor([7]))])  # type: ignore[arg-type]
    assert batch.last_rows.tolist() == [2, 3] and batch.positions.tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize(("rewindable", "invariant"), [(True, False), (False, False), (True, True)])
def test_the_scheduler_starts_requests_in_one_prompt_batch_where_the_model_rewinds(rewindable, invariant):
    """Together where the model rewinds; one by one for a recurrent state or under --batch-invariant."""
    engine = FakeEngine(rewindable=rewindable)
    engine.settings = StrataSettings(batch_invariant=invariant)
    scheduler = Scheduler(engine, parallel=4, max_queue=8, conv_cache=0, conv_cache_bytes=1 << 20, step_tokens=512)

    async def main() -> list:
        handles = [scheduler.submit(_request(f"prompt {i}", 4)) for i in range(4)]
        scheduler.start()  # after the four are queued: its first step admits them all
        return await asyncio.gather(*(_run(h) for h in handles))

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    together = rewindable and not invariant
    assert engine.batches[0] == (4 if together else 1) and max(engine.batches) == engine.batches[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prompt_batch_on_cuda_gives_the_tokens_of_its_chunks_alone(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), devices=["cuda:0"], max_context=256, parallel=4)
    prompts = [_prompt(i, n, engine.spec.vocab_size) for i, n in enumerate((37, 5, 120, 64))]
    want = []
    for prompt in prompts:
        session = engine.new_session()
        want.append(engine.prefill(session, prompt))
        engine.release_session(session)
    sessions = [engine.new_session() for _ in prompts]
    got = engine.prefill_batch(list(zip(sessions, prompts)))
    torch.testing.assert_close(got, torch.stack(want), rtol=2e-2, atol=2e-2)
    assert got.argmax(-1).tolist() == [int(w.argmax()) for w in want]
