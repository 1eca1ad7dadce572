"""``make-synthetic --copy``: a synthetic qwen3moe whose greedy output copies its prompt (synthetic_copy.py),
so n-gram speculation keeps its drafts; the same tensors as the random preset. Through the real engine on
the CPU; each assertion fails on the random preset (``test_the_random_preset_does_not_copy``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.quant import dequantize
from strata_core.serving.requests import Delta, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler
from strata_core.text.tokenizer import Tokenizer
from strata_core.tools.synthetic import PRESETS, write_synthetic

CODE_EDIT = Path(__file__).parent.parent / "tools" / "data" / "code_edit.jsonl"
NEW = 32  # greedy tokens generated after the prompt
PERIOD = 40  # the prompt's repeated sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The small preset, random (False) and copying (True)."""
    root = tmp_path_factory.mktemp("copy")
    paths = {copy: root / f"small-{copy}.gguf" for copy in (False, True)}
    for copy, path in paths.items():
        write_synthetic(path, "small", expert_type=Q.Q4_K, progress=False, copy=copy)
    return paths


@pytest.fixture(scope="module")
def prompt(models: dict[bool, Path]) -> list[int]:
    """40 distinct random tokens three times, then the first 5 again (the copy goes on from there); tokens
    of whole ASCII characters, so that each token's text delta carries it."""
    tokenizer = Tokenizer.from_gguf(GGUFFile.open(models[True]).metadata)
    whole = [t for t in range(PRESETS["small"].vocab) if tokenizer.decode([t]).isprintable()
             and tokenizer.decode([t]).isascii() and tokenizer.decode([t])]
    seq = [int(t) for t in np.random.default_rng(1).choice(whole, PERIOD, replace=False)]
    return seq * 3 + seq[:5]


def _generate(path: Path, prompt: list[int], spec_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt`` through the scheduler, and the tokens a decode window (the first
    token, from the prompt's window, not counted)."""
    engine = Engine.load(path, devices=["cpu"], max_context=512)
    scheduler = Scheduler(engine, parallel=1, max_queue=1, conv_cache=0, conv_cache_bytes=0, step_tokens=512,
                          spec_tokens=spec_tokens)

    async def main() -> list[int]:
        request = GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        return [t async for event in scheduler.submit(request) if isinstance(event, Delta) for t in event.tokens]

    scheduler.start()
    try:
        tokens = asyncio.run(main())
    finally:
        scheduler.stop()
        engine.close()
    stats = scheduler.stats
    return tokens, (stats.completion_tokens - stats.requests) / stats.windows


def _copied(prompt: list[int], tokens: list[int]) -> float:
    """The fraction of ``tokens`` that continue ``prompt``'s period."""
    expected = (prompt[:PERIOD] * 4)[len(prompt):len(prompt) + len(tokens)]
    return float(np.mean([a == b for a, b in zip(tokens, expected, strict=True)]))


def test_the_same_tensors_as_the_random_preset(models: dict[bool, Path]) -> None:
    """Names, shapes, block types and bytes as without --copy (the file is larger by its tokenizer's
    merges only); the experts' down projections zero."""
    files = {copy: GGUFFile.open(path) for copy, path in models.items()}
    listing = {copy: [(n, t.shape, t.qtype, t.nbytes) for n, t in f.tensors.items()] for copy, f in files.items()}
    assert listing[True] == listing[False]
    down = files[True].tensors["blk.3.ffn_down_exps.weight"]
    assert not dequantize(down.raw(), down.qtype, down.shape).any()
    gate = files[True].tensors["blk.3.ffn_gate_exps.weight"]
    assert torch.equal(gate.raw(), files[False].tensors["blk.3.ffn_gate_exps.weight"].raw())  # the preset's


def test_greedy_decoding_copies_the_prompt(models: dict[bool, Path], prompt: list[int]) -> None:
    tokens, _ = _generate(models[True], prompt, 0)
    assert len(tokens) == NEW and _copied(prompt, tokens) >= 0.9


def test_ngram_speculation_keeps_the_copy_s_drafts(models: dict[bool, Path], prompt: list[int]) -> None:
    """--spec ngram (4 drafts): the same tokens as without, at 3 or more tokens a decode window."""
    plain, _ = _generate(models[True], prompt, 0)
    spec, per_window = _generate(models[True], prompt, 4)
    assert spec == plain and per_window >= 3


def test_the_random_preset_does_not_copy(models: dict[bool, Path], prompt: list[int]) -> None:
    """What the tests above measure, on the random weights: little copying, few drafts kept."""
    tokens, _ = _generate(models[False], prompt, 0)
    _, per_window = _generate(models[False], prompt, 4)
    assert _copied(prompt, tokens) < 0.5 and per_window < 2


def test_the_copy_model_s_tokenizer_is_trained_on_code(models: dict[bool, Path]) -> None:
    """The code-editing prompts round-trip, in under half the random preset's tokens (about one a
    character there), with more distinct ones: indentation runs and keywords as single tokens."""
    tokenizers = {copy: Tokenizer.from_gguf(GGUFFile.open(path).metadata) for copy, path in models.items()}
    prompts = [json.loads(line)["prompt"] for line in CODE_EDIT.read_text().splitlines()]
    for text in prompts:
        ids = {copy: tok.encode(text) for copy, tok in tokenizers.items()}
        assert tokenizers[True].decode(ids[True]) == text
        assert len(ids[True]) < 0.5 * len(ids[False]) and len(set(ids[True])) > 1.5 * len(set(ids[False]))
    pieces = {tokenizers[True].decode([t]) for text in prompts for t in tokenizers[True].encode(text)}
    assert {"       ", " self", " return", " def"} <= pieces


def test_copy_needs_a_qwen3moe_preset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="qwen3moe"):
        write_synthetic(tmp_path / "x.gguf", "gpt-oss-tiny", progress=False, copy=True)
    with pytest.raises(ConfigError, match="dense-type"):
        write_synthetic(tmp_path / "x.gguf", "small", dense_type=Q.Q6_K, progress=False, copy=True)
