"""deepseek2 (MLA on the latent cache) on a CUDA device: prompts through the expanded form (fused
SDPA), decode windows through the absorbed form (eager and captured as CUDA graphs), against the CPU;
the Triton MLA kernel (``strata::mla_attention``) against its torch reference, and the engine's greedy
decode through the kernel against the torch form. The model is ``make-synthetic --preset
deepseek-tiny`` (Q4_K experts, Q8_0 dense, widths of 256).

The kernel test also runs on the CPU under the Triton interpreter:
``TRITON_INTERPRET=1 PYTHONPATH=<a CPU triton> pytest tests/test_deepseek2_cuda.py -k kernel``."""

from __future__ import annotations

import os

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.deepseek2.forward import ABSORBED_MAX_ROWS
from strata_core.ops import mla
from strata_core.tools.synthetic import write_synthetic

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and hasattr(mla, "mla_triton")
KERNEL_DEVICES = [pytest.param("cuda", marks=needs_cuda),
                  pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))]
PROMPT = [(7 * i) % 500 for i in range(3 * ABSORBED_MAX_ROWS)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads, C, R", [(128, 512, 64), (20, 64, 32), (2, 64, 32)])
@pytest.mark.parametrize("n", [1, 7, 300, 4100])
def test_mla_kernel_matches_the_reference(device, dtype, n_heads, C, R, n):
    """Each query row sees cache rows ``0..positions[t]`` of views into larger caches whose other rows
    are NaN (so a row read past the visible length shows); the kernel against the float64 reference on
    the same inputs: float32 within 2e-5, bf16 within 1e-2 + 2% (probabilities and output rounded to
    bf16; the torch form also rounds the scores)."""
    if device == "cpu" and n_heads * n > 20000:
        pytest.skip("too slow for the interpreter")
    gen = torch.Generator().manual_seed(n + n_heads)
    positions = torch.tensor([n - 1, (n - 1) // 2, 0])  # T = 3 query rows
    S, T, capacity = n + 5, len(positions), n + 9  # rows n..S-1 are in the view but not visible
    latent = torch.randn(capacity, C + 3, generator=gen).to(dtype)  # row stride C + 3: read in place
    rope = torch.randn(capacity, R, generator=gen).to(dtype)
    q_lat = torch.randn(n_heads, T, C, generator=gen).to(dtype)
    q_rope = torch.randn(T, n_heads, R, generator=gen).to(dtype).transpose(0, 1)  # [nh, T, R] strided
    scale = (C + R) ** -0.5
    want = mla.mla_reference(q_lat.double(), q_rope.double(), latent[:S, :C].double(), rope[:S].double(),
                             positions, scale)
    latent[n:, :C], rope[n:] = float("nan"), float("nan")
    args = [x.to(device) for x in (q_lat, q_rope, latent[:S, :C], rope[:S], positions)]
    run = torch.ops.strata.mla_attention if device == "cuda" else mla.mla_triton
    got = run(*args, scale)
    assert got.shape == (n_heads, T, C) and got.dtype == dtype
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    assert torch.equal(run(*args, scale), got)  # deterministic


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


@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
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
    eager = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32", cuda_graphs=False)
    graphs = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32",
                         cuda_graphs=True)
    for a, b in zip(_windows(graphs, [40, 70], 6), _windows(eager, [40, 70], 6)):
        assert _close(a, b, 1e-4)


def _greedy(engine: Engine, prompt_lens: list[int], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each session's greedy tokens after its prompt (decoded together), and the last logits."""
    sessions = [engine.new_session() for _ in prompt_lens]
    tokens = [[int(engine.prefill(s, PROMPT[:n]).argmax())] for s, n in zip(sessions, prompt_lens)]
    for _ in range(steps):
        logits = engine.decode_window([(s, t[-1]) for s, t in zip(sessions, tokens)])
        for t, row in zip(tokens, logits.argmax(-1).tolist()):
            t.append(row)
    return tokens, logits.cpu()


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_mla_kernel_greedy_decode_matches_the_torch_form(model, cuda_graphs):
    engine = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32", cuda_graphs=cuda_graphs)
    kernel_tokens, kernel_logits = _greedy(engine, [30, 100], 12)
    torch_engine = Engine.load(model, devices=["cuda:0"], max_context=256, dtype="float32", cuda_graphs=cuda_graphs,
                               mla_kernel=False)
    torch_tokens, torch_logits = _greedy(torch_engine, [30, 100], 12)
    assert kernel_tokens == torch_tokens
    assert _close(kernel_logits, torch_logits, 1e-4)
