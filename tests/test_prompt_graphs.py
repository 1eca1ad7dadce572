"""Prompt passes as CUDA graphs (runtime/prompt_graphs.py): the packed attention against one attention a
sequence, the packed pass's body (run eagerly on the CPU) against the eager prompt path, and on CUDA the
replayed passes against eager ones, without a host sync."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.model.ops import packed_causal_attention
from strata_core.runtime.prompt_graphs import PROMPT_BUCKETS, PromptGraphs, prompt_bucket
from strata_core.runtime.session import PromptBatch
from strata_core.testing.sync import no_host_sync

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_prompt_bucket_is_the_smallest_that_holds_the_pass():
    assert prompt_bucket(1) == PROMPT_BUCKETS[0]
    assert prompt_bucket(1000) == 1024 and prompt_bucket(1025) == 1536 and prompt_bucket(1024) == 1024
    assert prompt_bucket(PROMPT_BUCKETS[-1] + 1) is None
    assert prompt_bucket(700, largest=512) is None and prompt_bucket(500, largest=512) == 512


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(0, 5), st.sampled_from([1, 2]))
def test_packed_attention_is_each_sequences_own_causal_attention(lengths, pad, groups):
    """Sequences end to end (some empty), then ``pad`` padding rows as one more sequence: each row equals
    causal attention over its own sequence's rows alone."""
    torch.manual_seed(sum(lengths) + pad)
    nkv, D = 2, 8
    nh = nkv * groups
    T = sum(lengths) + pad
    q, k, v = torch.randn(T, nh, D), torch.randn(T, nkv, D), torch.randn(T, nkv, D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), T], dtype=torch.int32)
    got = packed_causal_attention(q, k, v, cu, max(T, 1))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1),
                                              is_causal=True)[0].transpose(0, 1).reshape(b - a, nh * D)
        torch.testing.assert_close(got[a:b], want, rtol=1e-5, atol=1e-5)


def _packed_logits(engine: Engine, prompts: list[list[int]], size: int) -> tuple[torch.Tensor, list]:
    """The body a prompt graph captures, run eagerly on ``engine``'s device over new sessions of ``prompts``
    padded to ``size`` tokens: the sessions' last logits and the sessions (their KV written, not committed)."""
    runner = engine.runner
    (segment,) = runner.segments("prompt")
    graphs = PromptGraphs(engine.model, segment.layers, engine.experts, segment.device, runner.device_of(segment),
                          runner._padding, 4, PROMPT_BUCKETS[-1], lambda: 0)
    sessions = [engine.new_session() for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        session.kv.reserve(len(prompt))
    batch = PromptBatch.of([(s, torch.tensor(p)) for s, p in zip(sessions, prompts)])
    inputs = {name: value.to(runner.device_of(segment)) for name, value in graphs._inputs(batch, size).items()}
    return graphs._body(size)(inputs)[:len(prompts)], sessions


@pytest.mark.parametrize("grouped", [False, True])
def test_the_packed_pass_body_matches_the_eager_prompt_path_on_cpu(tiny_model_factory, grouped):
    """Two new sessions packed and padded from 40 to 64 rows: the same last logits and K/V rows as each prompt
    through the eager path; ``grouped``: the experts through the grouped prefill, planned from the residency as
    a graphed pass plans them, with the same usage counts (the padding's routings not counted)."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = [list(range(5, 30)), list(range(40, 55))]
    engines = [Engine.load(path, devices=["cpu"], max_context=96, expert_cache=1000) for _ in range(2)]
    for engine in engines:
        engine.experts.use_grouped_prefill(grouped)
    eager_sessions = [engines[0].new_session() for _ in prompts]
    want = torch.stack([engines[0].prefill(s, p) for s, p in zip(eager_sessions, prompts)])
    got, sessions = _packed_logits(engines[1], prompts, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for eager, packed, prompt in zip(eager_sessions, sessions, prompts):
        for layer in range(3):
            a, b = eager.kv.read(layer, len(prompt)), packed.kv.read(layer, len(prompt))
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    if grouped:
        assert torch.equal(engines[1].experts.usage_profile().counts, engines[0].experts.usage_profile().counts)


def test_prompt_graphs_are_off_on_the_cpu_with_the_reason(tiny_model_factory, caplog):
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0", n_layers=2), devices=["cpu"], max_context=32)
    with caplog.at_level(logging.INFO, logger="strata_core.runtime.graph_replays"):
        engine.prefill(engine.new_session(), list(range(3, 12)))
        engine.prefill(engine.new_session(), list(range(3, 12)))
    said = [r.getMessage() for r in caplog.records if "prompt passes run eagerly" in r.getMessage()]
    assert len(said) == 1 and "not a local CUDA device" in said[0]
    assert engine.runner.prompt_graphs is None


class _FailingGraphs:
    """Prompt graphs whose replay raises (a failed capture): marked failed, as ``PromptGraphs._failing`` does."""

    device = torch.device("cpu")
    failed = None
    runs = 0

    def why_not(self, batch):
        return self.failed

    def run(self, batch):
        self.runs += 1
        self.failed = "a prompt graph failed (RuntimeError: capture)"
        raise RuntimeError("capture")


def test_a_failed_prompt_graph_leaves_the_passes_eager(tiny_model_factory, caplog):
    """The pass whose graph fails runs eagerly (the logits of an engine without graphs), said once; the next
    passes do not try again."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=2)
    reference = Engine.load(path, devices=["cpu"], max_context=64)
    want = reference.prefill(reference.new_session(), list(range(3, 12)))
    engine = Engine.load(path, devices=["cpu"], max_context=64)
    engine.runner._prompt_graphs = graphs = _FailingGraphs()
    with caplog.at_level(logging.WARNING, logger="strata_core.runtime.graph_replays"):
        got = [engine.prefill(engine.new_session(), list(range(3, 12))) for _ in range(2)]
    assert graphs.runs == 1
    assert all(torch.equal(g, want) for g in got)
    said = [r.getMessage() for r in caplog.records if "prompt passes run eagerly from now on" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: capture" in said[0]


def test_prompt_graphs_are_dropped_by_a_later_decode_capture_or_residency_change(tiny_model_factory):
    """The graphs held stay while nothing changed, and go when a decode graph was captured after them or a
    cache's residency changed (then captured again at the next pass)."""
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0", n_layers=2), devices=["cpu"], max_context=64)
    runner, captures = engine.runner, [0]
    (segment,) = runner.segments("prompt")
    graphs = PromptGraphs(engine.model, segment.layers, engine.experts, segment.device, runner.device_of(segment),
                          runner._padding, 4, PROMPT_BUCKETS[-1], lambda: captures[0])
    table = next(iter(engine.experts.tables.values()))
    for change in (lambda: captures.__setitem__(0, captures[0] + 1), table._publish):
        graphs._check_still_valid()
        graphs._graphs[16], graphs._pool = "a captured graph", "its memory pool"
        graphs._check_still_valid()
        assert graphs._graphs == {16: "a captured graph"}
        change()
        graphs._check_still_valid()
        assert graphs._graphs == {} and graphs._pool is None  # the pool went with its graphs: a new one next


# --- CUDA -----------------------------------------------------------------------------------------

def _cuda_engine(path, graphs: bool) -> Engine:
    return Engine.load(path, devices=["cuda:0"], max_context=256, dtype="bfloat16", arena="pinned",
                       expert_cache=1000, cuda_graphs=graphs)


@needs_cuda
def test_replayed_prompt_passes_equal_eager_ones_without_a_host_sync(tiny_model_factory):
    """One prompt, then three in one pass (one continuing a session: eager), replayed after a capture at
    start: last logits within bf16 tolerance of the eager engine's, the same greedy continuation, usage and
    hit counts; a replay makes no host sync."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = [list(range(5, 60)), list(range(70, 90)), list(range(3, 14))]
    results = []
    for graphs in (False, True):
        engine = _cuda_engine(path, graphs)
        engine.capture_prompt_graphs()
        sessions = [engine.new_session() for _ in prompts]
        extra = engine.new_session()  # the same prompt once more, alone: what the other engine counts too
        extra.kv.reserve(len(prompts[0]))
        if graphs:
            assert engine.runner.prompt_graphs is not None and len(engine.runner.prompt_graphs._graphs) > 0
            with no_host_sync():
                engine.runner.prompt_graphs.run(PromptBatch.of([(extra, torch.tensor(prompts[0]))]))
        else:
            engine.prefill(extra, prompts[0])
        first = engine.prefill(sessions[0], prompts[0])
        rest = engine.prefill_batch([(sessions[1], prompts[1]), (sessions[2], prompts[2])])
        more = engine.prefill(sessions[0], list(range(100, 110)))  # continues a session: eager
        tokens = [int(engine.decode_window([(sessions[1], int(rest[0].argmax()))])[0].argmax())]
        results.append((torch.cat([first[None], rest, more[None]]).float().cpu(), tokens,
                        engine.experts.usage_profile().counts.clone(), engine.telemetry.snapshot()["expert_hits"]))
    (want, want_tokens, want_usage, want_hits), (got, got_tokens, got_usage, got_hits) = results
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert got_tokens == want_tokens
    assert torch.equal(got_usage, want_usage) and got_hits == want_hits


@needs_cuda
def test_prompt_passes_after_a_later_decode_capture_equal_eager_ones(tiny_model_factory):
    """Prompt graphs captured first, then decode graphs of several buckets (a tool's order, not a server's):
    the next passes capture the prompt graphs again and give the eager engine's logits."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompts = [list(range(5, 60)), list(range(70, 90))]
    results = []
    for graphs in (False, True):
        engine = _cuda_engine(path, graphs)
        engine.capture_prompt_graphs()
        engine.capture_decode_graphs(8)
        logits = [engine.prefill(engine.new_session(), prompt) for prompt in prompts]
        torch.cuda.synchronize()
        results.append(torch.stack(logits).float().cpu())
        if graphs:
            assert len(engine.runner.prompt_graphs._graphs) > 0  # captured again, and replayed
    torch.testing.assert_close(results[1], results[0], rtol=3e-2, atol=3e-2)
