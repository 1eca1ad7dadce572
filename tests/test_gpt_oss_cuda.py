"""gpt-oss on a CUDA device against the CPU: prompts (grouped prefill with expert biases and
swiglu_oai, misses streamed), decode windows (the decode gather with the biased experts: the fused
SiLU kernel is not used for them) eager and captured as CUDA graphs. The model is
``make-synthetic --preset gpt-oss-tiny`` (MXFP4 experts, Q8_0 dense, window 8, sinks, YaRN)."""

from __future__ import annotations

import pytest
import torch

from strata_core.engine import Engine
from strata_core.synthetic import write_synthetic

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [(7 * i) % 500 for i in range(60)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny.gguf"
    write_synthetic(path, "gpt-oss-tiny", progress=False)
    return path


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a.float().cpu() - b.float().cpu()).abs().max().item() <= rel * b.abs().max().item()


def _windows(engine: Engine, prompt_lens: list[int], steps: int) -> list[torch.Tensor]:
    sessions = [engine.new_session() for _ in prompt_lens]
    for s, n in zip(sessions, prompt_lens):
        engine.prefill(s, PROMPT[:n])
    return [engine.decode_window([(s, PROMPT[n + step]) for s, n in zip(sessions, prompt_lens)]).cpu()
            for step in range(4)]


@needs_cuda
@pytest.mark.parametrize("dtype, rel", [("float32", 2e-3), ("bfloat16", 6e-2)])
@pytest.mark.parametrize("arena", ["mmap", "pinned"])  # pinned: decode windows take the decode gather
def test_prompt_and_decode_on_cuda_match_the_cpu(model, dtype, rel, arena):
    cpu = Engine.load(model, max_context=128)
    gpu = Engine.load(model, devices=["cuda:0"], max_context=128, dtype=dtype, expert_cache=12, arena=arena)
    reference = cpu.logits(PROMPT)
    assert _close(gpu.logits(PROMPT), reference, rel)
    gpu.settings.prefill_chunk = 7  # chunks across the window of 8
    assert _close(gpu.logits(PROMPT), reference, rel)
    for a, b in zip(_windows(gpu, [20, 45], 4), _windows(cpu, [20, 45], 4)):
        assert _close(a, b, rel)


@needs_cuda
def test_decode_windows_replayed_as_cuda_graphs_match_eager(model):
    eager = Engine.load(model, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned")
    graphs = Engine.load(model, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                         cuda_graphs=True)
    for a, b in zip(_windows(graphs, [30, 50], 4), _windows(eager, [30, 50], 4)):
        assert _close(a, b, 1e-4)
