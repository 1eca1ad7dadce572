"""Qwen3-Next on a CUDA device: the chunked Gated DeltaNet (flash-linear-attention's kernel when
installed, else the torch chunked form) against the recurrent form, and the engine (prompts
chunked, decode windows eager and captured as CUDA graphs, a hand-off between two slots) against the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata_core.engine import Engine
from strata_core.model.qwen3next import deltanet
from strata_core.model.qwen3next.deltanet import delta_rule, delta_rule_recurrent, l2_norm

DATA = Path(__file__).parent / "data" / "qwen3next_llamacpp"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = [(7 * i) % 300 for i in range(150)]
FORMS = ["torch", "fla"]


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` relative to ``b``'s largest magnitude."""
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.abs().max()).item()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return _distance(a, b) <= rel


def _form(form: str) -> str:
    """``form`` (a ``deltanet_chunked`` value); skips "fla" where fla-core is not installed."""
    if form == "fla" and deltanet.fla_chunk() is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    return form


#: float32 through fla's Triton kernels takes TF32 products (10-bit mantissas): a wider tolerance
FLA_FLOAT32 = 1e-2


@needs_cuda
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
def test_chunked_delta_rule_on_cuda_matches_the_recurrent_form(form, dtype, rel):
    """Qwen3-Next-80B's shapes: 16 key heads, 32 value heads of 128; a state carried in."""
    _form(form)
    rel = max(rel, FLA_FLOAT32) if form == "fla" else rel
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, Hk, Hv, D = 300, 16, 32, 128
    q, k = (l2_norm(torch.randn(T, Hk, D, device="cuda", generator=gen), 1e-6) for _ in range(2))
    v = torch.randn(T, Hv, D, device="cuda", generator=gen)
    g = -torch.rand(T, Hv, device="cuda", generator=gen) * 0.3
    beta = torch.rand(T, Hv, device="cuda", generator=gen)
    s0 = 0.1 * torch.randn(Hv, D, D, device="cuda", generator=gen)
    ref_state = s0.clone()
    ref = delta_rule_recurrent(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, g, beta, ref_state)
    state = s0.clone()
    out = delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state, Hk, form)
    assert out.dtype == torch.float32 and _close(out, ref, rel) and _close(state, ref_state, rel)


@pytest.mark.usefixtures("float_cpu_kernels")  # CUDA's float products against the CPU's: the CPU kernels' float bodies
@needs_cuda
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype, rel", [("float32", 2e-3), ("bfloat16", 6e-2)])
def test_engine_on_cuda_matches_the_cpu(form, dtype, rel):
    """Against float32 on the CPU. In bf16 the rounding of this random model's recurrent state grows
    along the prompt (the CPU's own bf16 is about 40% off float32 by position 100, as in Hugging Face
    transformers), so there the bound is twice the CPU's own bf16 distance, where that is larger."""
    rel = max(rel, FLA_FLOAT32) if form == "fla" else rel
    cpu = Engine.load(DATA / "model-q8_0.gguf", max_context=256)
    gpu = Engine.load(DATA / "model-q8_0.gguf", devices=["cuda:0"], max_context=256, dtype=dtype, expert_cache=8,
                      prefill_chunk=100, arena="pinned", deltanet_chunked=_form(form))
    reference = cpu.logits(PROMPT)
    if dtype == "bfloat16":
        own = Engine.load(DATA / "model-q8_0.gguf", max_context=256, dtype=dtype)
        rel = max(rel, 2 * _distance(own.logits(PROMPT), reference))
    assert _close(gpu.logits(PROMPT), reference, rel)  # two chunks: the state carried between them
    for cuda_graphs in (False, True):  # decode windows continue the recurrent state, eager and captured
        gpu.settings.cuda_graphs = cuda_graphs
        sessions = [gpu.new_session() for _ in range(2)]
        for s, n in zip(sessions, (60, 90)):
            gpu.prefill(s, PROMPT[:n])
        for step in range(3):
            rows = gpu.decode_window([(s, PROMPT[n + step]) for s, n in zip(sessions, (60, 90))])
            for row, n in zip(rows, (60, 90)):
                assert _close(row, reference[n + step], rel)


@needs_cuda
def test_hand_off_on_cuda_equals_single():
    options = dict(max_context=256, dtype="float32", arena="pinned")
    single = Engine.load(DATA / "model-q8_0.gguf", devices=["cuda:0"], expert_cache=12, **options)
    split = Engine.load(DATA / "model-q8_0.gguf", strategy="prefill_main", devices=["cuda:0", "cuda:0"],
                        expert_cache=6, dbg_handoff=True, strategy_options={"split": "1"}, **options)
    assert split.generate(PROMPT, max_tokens=8, temperature=0) == single.generate(PROMPT, max_tokens=8,
                                                                                 temperature=0)
