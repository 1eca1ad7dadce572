"""deepseek2 (MLA on the latent cache) on a CUDA device: prompts through the expanded form (fused
SDPA), decode windows through the absorbed form (eager and captured as CUDA graphs), against the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.deepseek2 import ABSORBED_MAX_ROWS

DATA = Path(__file__).parent / "data" / "deepseek3_llamacpp"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [(7 * i) % 300 for i in range(3 * ABSORBED_MAX_ROWS)]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a.float().cpu() - b.float().cpu()).abs().max().item() <= rel * b.abs().max().item()


def _windows(engine: Engine, prompt_lens: list[int], steps: int) -> list[torch.Tensor]:
    sessions = [engine.new_session() for _ in prompt_lens]
    for s, n in zip(sessions, prompt_lens):
        engine.prefill(s, PROMPT[:n])
    out = []
    for step in range(steps):
        out.append(engine.decode_window([(s, PROMPT[n + step]) for s, n in zip(sessions, prompt_lens)]).cpu())
    return out


@needs_cuda
@pytest.mark.parametrize("dtype, rel", [("float32", 2e-3), ("bfloat16", 6e-2)])
def test_mla_prompt_and_decode_on_cuda_match_the_cpu(dtype, rel):
    cpu = Engine.load(DATA / "model-q8_0.gguf", max_context=256)
    gpu = Engine.load(DATA / "model-q8_0.gguf", devices=["cuda:0"], max_context=256, dtype=dtype, expert_cache=8)
    reference = cpu.logits(PROMPT)
    assert _close(gpu.logits(PROMPT), reference, rel)  # one chunk: the expanded form
    gpu.settings.prefill_chunk = ABSORBED_MAX_ROWS // 2  # chunks of the absorbed form
    assert _close(gpu.logits(PROMPT), reference, rel)
    for a, b in zip(_windows(gpu, [50, 90], 4), _windows(cpu, [50, 90], 4)):
        assert _close(a, b, rel)


@needs_cuda
def test_mla_decode_windows_replayed_as_cuda_graphs_match_eager():
    eager = Engine.load(DATA / "model-q8_0.gguf", devices=["cuda:0"], max_context=256, dtype="float32")
    graphs = Engine.load(DATA / "model-q8_0.gguf", devices=["cuda:0"], max_context=256, dtype="float32",
                         cuda_graphs=True)
    for a, b in zip(_windows(graphs, [40, 70], 6), _windows(eager, [40, 70], 6)):
        assert _close(a, b, 1e-4)
