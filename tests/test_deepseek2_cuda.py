"""deepseek2 (MLA on the latent cache) on a CUDA device: prompts through the expanded form (fused
SDPA), decode windows through the absorbed form (eager and captured as CUDA graphs), against the CPU.
The model is ``make-synthetic --preset deepseek-tiny`` (Q4_K experts, Q8_0 dense, widths of 256)."""

from __future__ import annotations

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.deepseek2 import ABSORBED_MAX_ROWS
from strata_core.synthetic import write_synthetic

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [(7 * i) % 500 for i in range(3 * ABSORBED_MAX_ROWS)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek") / "deepseek-tiny.gguf"
    write_synthetic(path, "deepseek-tiny", progress=False)
    return path


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Each row's largest difference within ``rel`` of the row's largest logit, on average over the
    rows (bf16 flips a near-tie routing now and then, which moves that row much more)."""
    a, b = a.float().cpu(), b.float().cpu()
    error = ((a - b).abs().amax(-1) / b.abs().amax(-1)).mean().item()
    return error <= rel and (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75


def _windows(engine: Engine, prompt_lens: list[int], steps: int) -> list[torch.Tensor]:
    sessions = [engine.new_session() for _ in prompt_lens]
    for s, n in zip(sessions, prompt_lens):
        engine.prefill(s, PROMPT[:n])
    out = []
    for step in range(steps):
        out.append(engine.decode_window([(s, PROMPT[n + step]) for s, n in zip(sessions, prompt_lens)]).cpu())
    return out


@needs_cuda
@pytest.mark.parametrize("dtype, rel", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_mla_prompt_and_decode_on_cuda_match_the_cpu(model, dtype, rel):
    cpu = Engine.load(model, max_context=256)
    gpu = Engine.load(model, devices=["cuda:0"], max_context=256, dtype=dtype, expert_cache=6)
    reference = cpu.logits(PROMPT)
    assert _close(gpu.logits(PROMPT), reference, rel)  # one chunk: the expanded form
    gpu.settings.prefill_chunk = ABSORBED_MAX_ROWS // 2  # chunks of the absorbed form
    assert _close(gpu.logits(PROMPT), reference, rel)
    for a, b in zip(_windows(gpu, [50, 90], 4), _windows(cpu, [50, 90], 4)):
        assert _close(a, b, rel)


@needs_cuda
def test_mla_decode_windows_replayed_as_cuda_graphs_match_eager(model):
    eager = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32")
    graphs = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32",
                         cuda_graphs=True)
    for a, b in zip(_windows(graphs, [40, 70], 6), _windows(eager, [40, 70], 6)):
        assert _close(a, b, 1e-4)
