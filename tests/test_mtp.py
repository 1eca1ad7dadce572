"""MTP speculative decoding (``--spec mtp``: strata_core/model/mtp.py, strata_core/serving/mtp_drafts.py) on
synthetic qwen3next GGUFs with a next-token-prediction block: output identical to output without drafts,
greedy and sampled; a block built to predict the main model's tokens gets its drafts kept; the block's
KV after windows with rejected drafts is the one of the final tokens computed at once; a model without
the block is a clear error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from test_server_support import serve_together

from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.mtp import BlockExperts, mtp_block_spec
from strata_core.model.registry import load_model_spec
from strata_core.serving.requests import GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.tools.synthetic import PRESETS, write_synthetic

PRESET = "qwen3-next-tiny"


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen3next preset with one MTP block, random weights."""
    path = tmp_path_factory.mktemp("mtp") / "mtp.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, mtp_layers=1, progress=False)
    return path


@pytest.fixture(scope="module")
def bigram_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shapes, every layer's output projections zero, so each next token is a function of the
    token before it alone; the MTP block is that function too (``eh_proj`` passes the embedding through,
    its layer adds nothing, its head norm is the output norm): its drafts are the tokens the model draws."""
    path = tmp_path_factory.mktemp("mtp") / "bigram.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, dense_type=Q.F32, mtp_layers=1, progress=False)
    reader = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t.data for t in reader.tensors}
    for name, data in tensors.items():
        if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
            data[...] = 0
    block, hidden = f"blk.{PRESETS[PRESET].n_layers}.nextn.", PRESETS[PRESET].hidden
    eh_proj = tensors[block + "eh_proj.weight"]  # [H, 2H]: the embedding's half the identity
    eh_proj[...] = 0
    eh_proj[:, :hidden] = np.eye(hidden, dtype=np.float32)
    tensors[block + "enorm.weight"][...] = 1
    tensors[block + "shared_head_norm.weight"][...] = tensors["output_norm.weight"]
    reader.data.flush()
    return path




def _requests(engine: Engine) -> list[GenerationRequest]:
    tok = engine.tokenizer
    return [GenerationRequest(tok.encode("the quick brown fox jumps " * 3),
                              SamplingParams(temperature=0, max_tokens=16)),
            GenerationRequest(tok.encode("hello world"), SamplingParams(temperature=0, max_tokens=12, stop=("zz",))),
            GenerationRequest(tok.encode("sampled"), SamplingParams(temperature=0.9, seed=3, top_k=40, max_tokens=12))]


CUDA_INVARIANT = dict(devices=["cuda:0"], arena="pinned", batch_invariant=True)


@pytest.mark.parametrize("options", [pytest.param({}, id="cpu"), pytest.param(
    CUDA_INVARIANT, id="cuda-invariant", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("model", ["mtp_model", "bigram_model"])
def test_output_with_mtp_drafts_is_the_output_without(model: str, options: dict,
                                                      request: pytest.FixtureRequest) -> None:
    """Greedy and seeded sampled requests give the same text with MTP drafts as without, the drafts
    verified in the windows; the bigram model's block drafts what greedy decoding draws, so its greedy
    requests keep nearly every draft, in fewer windows. On CUDA under ``--batch-invariant`` (a window's
    kernels otherwise depend on its rows)."""
    engine = Engine.load(request.getfixturevalue(model), max_context=128, spec="mtp", **options)
    try:
        requests = _requests(engine)
        plain, without = serve_together(engine, requests, 0, "mtp")
        spec, with_mtp = serve_together(engine, requests, 3, "mtp")
        if model == "bigram_model":
            _, greedy = serve_together(engine, requests[:2], 3, "mtp")
    finally:
        engine.close()
    assert spec == plain
    assert with_mtp.stats.completion_tokens == without.stats.completion_tokens
    assert with_mtp.stats.draft_tokens > 0
    if model == "bigram_model":
        assert greedy.stats.accepted_tokens >= 0.9 * greedy.stats.draft_tokens > 0
        assert with_mtp.stats.windows < without.stats.windows


def test_the_block_s_kv_follows_the_session(mtp_model: Path) -> None:
    """A session decoded in windows of drafted rows, some rejected (the session cut back), and cut back
    past positions the block had been fed (as a slot's session reused for a new prompt), drafts what a
    session holding the same tokens from one prompt drafts: the block's KV was cut back with it."""
    engine = Engine.load(mtp_model, max_context=128, spec="mtp")
    try:
        assert engine.mtp is not None
        prompt = engine.tokenizer.encode("strata streams experts from host memory")
        session = engine.new_session()
        tokens = list(prompt) + [7]  # the session's tokens and the pending one
        engine.prefill(session, prompt)
        for cut, kept, rows in ((0, 1, 4), (0, 0, 3), (0, 3, 4), (3, 2, 3), (0, 1, 2)):
            engine.mtp.draft(session, tokens, 3)
            if cut:  # the token at the cut stays: the one pending there
                session.truncate(session.n_tokens - cut)
                tokens = tokens[:session.n_tokens + 1]
            held = session.n_tokens
            window = tokens[-1:] + [11 + i for i in range(rows - 1)]  # the pending token and made-up drafts
            engine.decode_window([(session, t) for t in window])
            session.truncate(held + 1 + kept)
            tokens = tokens[:held + 1] + window[1:1 + kept] + [5 + kept]
        drafted = engine.mtp.draft(session, tokens, 3)
        fresh = engine.new_session()
        engine.prefill(fresh, tokens[:-1])
        assert engine.mtp.draft(fresh, tokens, 3) == drafted
        assert len(drafted) == 3
    finally:
        engine.close()


def test_a_prompt_fed_to_the_block_takes_one_head_row(mtp_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's first draft feeds the block every prompt row at once; only the last row's logits are read,
    so the block's head computes that row alone (a head product a row made a long prompt's first draft
    slow), and the drafts are those of the prompt fed a row at a time."""
    engine = Engine.load(mtp_model, max_context=128, spec="mtp")
    try:
        assert engine.mtp is not None
        head = engine.mtp.head.model
        rows: list[int] = []
        real = head.head
        monkeypatch.setattr(head, "head", lambda hidden: rows.append(hidden.shape[0]) or real(hidden))
        prompt = engine.tokenizer.encode("strata streams experts from host memory to the device")
        tokens = list(prompt) + [7]
        at_once = engine.new_session()
        engine.prefill(at_once, prompt)
        drafted = engine.mtp.draft(at_once, tokens, 2)
        assert rows == [1, 1]  # the prompt's last row, then the chained draft's
        one_by_one = engine.new_session()
        engine.prefill(one_by_one, prompt[:1])
        for n in range(1, len(prompt)):
            engine.mtp.draft(one_by_one, tokens[:n + 1], 1)
            engine.prefill(one_by_one, prompt[n:n + 1])
        assert engine.mtp.draft(one_by_one, tokens, 2) == drafted
    finally:
        engine.close()


def test_spec_min_p_ends_the_drafts_before_the_first_unlikely_one(mtp_model: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--spec-min-p m``: the drafts are those without it up to the first the block gives less than ``m``
    probability (the chain's probabilities recorded as it drafts); the output is still the one without
    drafts; with ``--spec ngram`` it is an error."""
    from pydantic import ValidationError

    from strata_core.config import StrataSettings
    from strata_core.serving import mtp_drafts

    chain: list[float] = []
    greedy = mtp_drafts._greedy
    monkeypatch.setattr(mtp_drafts, "_greedy", lambda logits: chain.append(greedy(logits)[1]) or greedy(logits))
    engine = Engine.load(mtp_model, max_context=128, spec="mtp", spec_min_p=0.0)
    try:
        assert engine.mtp is not None
        prompt = engine.tokenizer.encode("strata streams experts from host memory")
        session = engine.new_session()
        engine.prefill(session, prompt)
        tokens = list(prompt) + [7]
        full = engine.mtp.draft(session, tokens, 4)
        probs = chain[-4:]  # the last prompt entry's draft, then the three chained
        assert len(full) == 4 and 0 < min(probs) < 1
        for m in sorted({0.0, *probs, *(p + 1e-6 for p in probs), 1.0}):
            engine.mtp.min_p = m
            cut = next((i for i, p in enumerate(probs) if p < m), 4)
            assert engine.mtp.draft(session, tokens, 4) == full[:cut], (m, probs)
        engine.mtp.min_p = sorted(probs)[1] + 1e-6  # some windows draft fewer, some none
        plain, _ = serve_together(engine, _requests(engine), 0, "mtp")
        spec, _ = serve_together(engine, _requests(engine), 3, "mtp")
    finally:
        engine.close()
    assert spec == plain
    with pytest.raises(ValidationError, match="--spec-min-p applies to --spec mtp"):
        StrataSettings(model=mtp_model, spec="ngram", spec_min_p=0.5)


def test_mtp_needs_next_token_prediction_layers(tmp_path: Path) -> None:
    """``--spec mtp`` on a model without nextn layers is one error naming the file and the problem."""
    path = tmp_path / "plain.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q8_0, progress=False)
    with pytest.raises(ConfigError, match=r"plain\.gguf.*no next-token-prediction layers.*--spec ngram"):
        Engine.load(path, max_context=128, spec="mtp")
    with pytest.raises(ConfigError, match="no multi-token-prediction layers to add"):
        write_synthetic(tmp_path / "x.gguf", "tiny", mtp_layers=1, progress=False)


def test_spec_mtp_on_the_server(bigram_model: Path) -> None:
    """``--spec mtp`` through the server's settings: the greedy completion is the one without drafts, and
    /metrics counts the drafts, the kept ones and the tokens a window."""
    import httpx
    from test_server_support import live_server

    from strata_core.config import StrataSettings

    texts, metrics = {}, ""
    for spec in ("off", "mtp"):
        settings = StrataSettings(model=bigram_model, model_alias="m", max_context=128, spec=spec, spec_tokens=3)
        with live_server(settings) as url:
            body = {"model": "m", "prompt": "hello world", "max_tokens": 16, "temperature": 0}
            texts[spec] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            metrics = httpx.get(f"{url}/metrics").text
    assert texts["mtp"] == texts["off"]
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("strata_")}
    assert values["strata_spec_draft_tokens_total"] > 0 and values["strata_spec_acceptance_ratio"] > 0.5
    assert values["strata_tokens_per_window"] > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("float_cpu_kernels")
def test_the_block_s_experts_on_cuda_match_the_cpu_s(tmp_path: Path) -> None:
    """The MTP block's routed experts on CUDA (the fused decode MoE op over the packed experts, no host read)
    within the bf16 tolerance of the CPU's (the block kernels, expert by expert), for a draft's one row and a
    prompt's many."""
    path = tmp_path / "q4k.gguf"
    write_synthetic(path, PRESET, expert_type=Q.Q4_K, mtp_layers=1, progress=False)
    gguf_file = GGUFFile.open(path)
    spec = load_model_spec(gguf_file)
    block = mtp_block_spec(path, spec)
    on_cpu, on_cuda = (BlockExperts(gguf_file, block, spec.n_layers, torch.device(d)) for d in ("cpu", "cuda"))
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 37):
        ids = torch.stack([torch.randperm(block.n_experts, generator=gen)[:block.n_experts_used]
                           for _ in range(tokens)])
        weights = torch.rand(tokens, block.n_experts_used, generator=gen)
        x = (torch.randn(tokens, block.hidden_size, generator=gen) * 0.5).to(torch.bfloat16)
        want = on_cpu(0, x.float(), ids, weights).double()
        got = on_cuda(0, x.cuda(), ids.cuda(), weights.cuda()).double().cpu()
        assert got.shape == want.shape
        assert ((got - want).norm() / want.norm()).item() < 2e-2
