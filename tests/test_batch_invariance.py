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


def test_products_off_the_cpu_pad_their_rows_under_invariant_rows_alone(monkeypatch):
    """Off the CPU a product's rows go as they are, and padded to ``INVARIANT_ROWS`` while ``invariant_rows``
    is on (``--batch-invariant`` decode windows: one cuBLAS shape for every window)."""
    from strata_core.ops.matmul import INVARIANT_ROWS, invariant_rows

    rows = []
    product = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: rows.append(a.shape[-2]) or product(a, b))
    x, weight = torch.empty(3, 8, device="meta"), torch.empty(5, 8, device="meta")
    assert linear(x, weight).shape == (3, 5)
    with invariant_rows():
        assert linear(x, weight).shape == (3, 5)
        assert linear(torch.empty(2, 70, 8, device="meta"), weight).shape == (2, 70, 5)
    assert linear(x, weight).shape == (3, 5)
    assert rows == [3, INVARIANT_ROWS, 3 * INVARIANT_ROWS, 3]  # 140 rows: three tiles


def _greedy(engine: Engine, prompts: list[list[int]], windows: int, together: bool) -> tuple[list, list]:
    """Greedy decode of ``prompts``: in one batch (``together``) or each alone; tokens and logits per prompt."""
    groups = [prompts] if together else [[p] for p in prompts]
    tokens, logits = [], []
    for group in groups:
        sessions = [engine.new_session() for _ in group]
        fed = [int(engine.prefill(s, p).argmax()) for s, p in zip(sessions, group)]
        seqs, rows = [[t] for t in fed], [[] for _ in group]
        for _ in range(windows):
            out = engine.decode_window(list(zip(sessions, fed))).cpu()
            fed = out.argmax(-1).tolist()
            for seq, row, t, logit in zip(seqs, rows, fed, out):
                seq.append(t)
                row.append(logit)
        for s in sessions:
            engine.release_session(s)
        tokens += seqs
        logits += rows
    return tokens, logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"])
def test_batch_invariant_decode_on_cuda_gives_each_session_its_logits_alone(arch, tiny_model_factory):
    """``--batch-invariant`` on CUDA: three sessions decoded in one window (a graph of bucket 4, a padded
    row) give bit for bit the logits and the greedy tokens of each decoded alone, through the fused layers
    (qwen3moe) and through the others (padded dense products, attention row by row over the whole capacity,
    eager windows as replayed ones, stand-ins)."""
    path = ({"gpt-oss": GPT_OSS, "qwen3next": QWEN3NEXT, "deepseek2": DEEPSEEK2}.get(arch)
            or tiny_model_factory(expert_type="Q4_0", n_layers=3))
    engine = Engine.load(path, devices=["cuda:0"], max_context=128, arena="pinned", batch_invariant=True)
    prompts = [list(range(5, 60)), list(range(70, 90)), list(range(3, 14))]
    alone, alone_logits = _greedy(engine, prompts, 8, together=False)
    batched, batched_logits = _greedy(engine, prompts, 8, together=True)
    assert batched == alone
    assert all(torch.equal(a, b) for rows_a, rows_b in zip(alone_logits, batched_logits) for a, b in zip(rows_a, rows_b))
