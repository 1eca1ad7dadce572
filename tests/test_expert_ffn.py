"""``ExpertFFN`` (expert biases + swiglu_oai, gpt-oss) in every expert path on the CPU: the grouped
products agree with the reference ``expert_ffn`` within tolerance, the decode gather's per-pair rows
are its bits; swiglu_oai is llama.cpp's formula."""

from __future__ import annotations

import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.experts.backend import build_expert_backend
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.gather import pair_ffn
from strata_core.experts.grouped import dequantize_experts, grouped_ffn
from strata_core.experts.rows import expert_ffn
from strata_core.plugin.placement import DeviceSlot, Placement

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _arena(synthetic):
    weights, spec, _ = synthetic
    placement = Placement.stages([(0, range(spec.n_layers))])
    return build_expert_backend(weights, spec, placement, {0: DeviceSlot(0, CPU)}, StrataSettings(), {CPU: 0}).arena


def _biased(spec, dtype=torch.float32) -> ExpertFFN:
    gen = torch.Generator().manual_seed(1)
    E, F, H = spec.n_experts, spec.expert_ffn_size, spec.hidden_size
    return ExpertFFN("swiglu_oai", *(torch.randn(n, m, generator=gen).to(dtype) for n, m in ((E, F), (E, F), (E, H))))


def test_swiglu_oai_is_llamacpps_formula():
    g = torch.tensor([-9.0, -1.0, 0.5, 6.9, 7.0, 12.0])
    u = torch.tensor([-12.0, 3.0, -0.5, 8.0, -7.5, 0.25])
    x, y = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    want = x / (1 + torch.exp(-1.702 * x)) * (y + 1)  # ggml_compute_forward_swiglu_oai_f32
    torch.testing.assert_close(ExpertFFN("swiglu_oai").glu(g, u), want)
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        ExpertFFN("gelu")


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("width", [8, 16, 24, 40])
def test_glu_rows_do_not_depend_on_the_row_count(activation, width):
    """An expert's rows are computed in groups of any size: on the CPU a row's activation is the same
    bits alone as among 23 others (an unpadded SiLU ran a one-row group's 16 values through the scalar
    tail on AVX-512, and deepseek2's logits moved with the chunk size)."""
    gen = torch.Generator().manual_seed(width)
    g, u = (torch.randn(24, width, generator=gen) * 4 for _ in range(2))
    ffn = ExpertFFN(activation)
    alone = torch.cat([ffn.glu(g[i:i + 1], u[i:i + 1]) for i in range(24)])
    assert torch.equal(ffn.glu(g, u), alone)


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped float product against the per-expert kernels: the CPU kernels' float bodies
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_ffn_applies_biases_and_activation_like_expert_ffn(synthetic, dtype):
    _, spec, _ = synthetic
    arena = _arena(synthetic)
    fmt = arena.formats[0]
    experts, counts = [3, 0, 9, 15], [4, 1, 17, 6]
    ffn = _biased(spec, dtype)
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, e)]) for e in experts])  # [G, total]
    x = torch.randn(sum(counts), spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)  # [n, H]
    got = grouped_ffn(x, *dequantize_experts(packed, fmt, dtype), torch.tensor(counts), max(counts),
                      ffn=ffn, experts=torch.tensor(experts))
    want = torch.cat([expert_ffn(xs, *arena.parts(0, e), fmt.qtypes, fmt.shapes, ffn, e)
                      for e, xs in zip(experts, x.split(counts))])  # [n, H]
    plain = torch.cat([expert_ffn(xs, *arena.parts(0, e), fmt.qtypes, fmt.shapes, SILU, e)
                       for e, xs in zip(experts, x.split(counts))])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert not torch.allclose(got.float(), plain.float(), rtol=0.1, atol=0.1 * want.abs().max().item())


def test_pair_rows_are_expert_ffn_bits_with_biases(synthetic):
    _, spec, _ = synthetic
    arena = _arena(synthetic)
    fmt = arena.formats[1]
    ffn = _biased(spec)
    expert = torch.tensor([5, 2, 5, 11, 0, 2])  # [P]
    x = torch.randn(expert.numel(), spec.hidden_size, generator=torch.Generator().manual_seed(2))  # [P, H]
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(1, int(e))]) for e in expert])  # [P, total]
    got = pair_ffn(x, packed, fmt, ffn, expert)
    for p, e in enumerate(expert.tolist()):
        want = expert_ffn(x[p:p + 1], *arena.parts(1, e), fmt.qtypes, fmt.shapes, ffn, e)  # [1, H]
        assert torch.equal(got[p:p + 1], want)


@pytest.mark.usefixtures("float_cpu_kernels")  # the grouped float product against the per-expert kernels: the CPU kernels' float bodies
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_rows_of_the_gpu_path_agree_with_the_reference(synthetic, dtype):
    """``pair_ffn_grouped`` (what a GPU's decode gather runs for biased experts) is ``pair_ffn``'s rows
    within float tolerance."""
    from strata_core.experts.gather import pair_ffn_grouped

    _, spec, _ = synthetic
    arena = _arena(synthetic)
    fmt = arena.formats[0]
    ffn = _biased(spec, dtype)
    expert = torch.tensor([5, 2, 5, 11, 0, 2, 15, 7])  # [P]
    x = torch.randn(expert.numel(), spec.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    packed = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, int(e))]) for e in expert])
    got, want = pair_ffn_grouped(x, packed, fmt, ffn, expert), pair_ffn(x, packed, fmt, ffn, expert)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def _op_case(spec, arena, fmt, ffn):
    """Args of ``moe_pair_rows`` for 3 tokens x top-2 over a cache holding 3 of the layer's experts."""
    from strata_core.ops.moe import ffn_args

    gen = torch.Generator().manual_seed(4)
    held = torch.tensor([5, 2, 9])
    cache = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, int(e))]) for e in held])  # [3, total]
    expert = torch.tensor([5, 0, 2, 7, 9, 5])  # [P]
    slot = torch.tensor([0, -1, 1, -1, 2, 0])
    layer = torch.stack([torch.cat([p.reshape(-1) for p in arena.parts(0, e)]) for e in range(spec.n_experts)])
    x = torch.randn(3, spec.hidden_size, generator=gen)  # [T, H]
    args = (x, cache, layer, slot, expert, 2, [int(q) for q in fmt.qtypes], [n for s in fmt.shapes for n in s],
            list(fmt.nbytes))
    return args, ffn_args(ffn), expert, cache, layer


def test_moe_ops_apply_the_biases_and_activation(synthetic):
    """``moe_pair_rows`` / ``moe_decode`` with an ExpertFFN: the CPU kernels are the gather then
    ``pair_ffn`` with it (bit for bit), and their schema passes opcheck."""
    from strata_core.ops.combine import combine_rows
    from strata_core.ops.gather import gather_experts
    from strata_core.ops.moe import moe_decode, moe_pair_rows

    _, spec, _ = synthetic
    arena = _arena(synthetic)
    fmt, ffn = arena.formats[0], _biased(spec)
    args, kwargs, expert, cache, layer = _op_case(spec, arena, fmt, ffn)
    rows = moe_pair_rows(*args, **kwargs)
    packed = gather_experts(cache, layer, args[3], expert, fmt.total)
    assert torch.equal(rows, pair_ffn(args[0].repeat_interleave(2, 0), packed, fmt, ffn, expert))
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(5))
    combined = moe_decode(*args[:5], weights, *args[5:], **kwargs)
    assert torch.equal(combined, combine_rows(rows.view(3, 2, -1), weights))
    torch.library.opcheck(torch.ops.strata.moe_pair_rows.default, args, kwargs)
