"""The fused decode ops' CUDA kernels against their CPU references (strata_core/ops/decode.py,
``strata::moe_decode``); runs where CUDA exists (the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.model.rope import scaled_inv_freq
from strata_core.ops.decode import add_rms_norm, decode_attention, kv_table, rope_kv_write, route_topk
from strata_core.ops import moe
from strata_core.ops.moe import moe_decode
from test_kernels import experts, op_args
from test_kernels_cuda import _moe_case, rel

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("float_cpu_kernels")]  # CUDA's float products against the CPU's

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.cpu().float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel(dtype):
    gen = torch.Generator().manual_seed(0)
    h, d = (torch.randn(4, 2048, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(2048, generator=gen) + 0.5).to(dtype)
    got = add_rms_norm(h.cuda(), d.cuda(), w.cuda(), 1e-6)
    want = add_rms_norm(h, d, w, 1e-6)
    assert _rel(got[0], want[0]) <= TOL[dtype] / 2 and _rel(got[1], want[1]) <= TOL[dtype]


@pytest.mark.parametrize("norm, scale", [(True, 1.0), (False, 2.5)])
def test_route_topk_kernel(norm, scale):
    logits = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))  # float32: no ties, one order
    ids, weights = route_topk(logits.cuda(), 8, norm, scale, 6e-5)
    want_ids, want_weights = route_topk(logits, 8, norm, scale, 6e-5)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-7)
    torch.library.opcheck(torch.ops.strata.route_topk.default, (logits.cuda(), 8, norm, scale, 6e-5))


def _paged(B, S, nkv, D, dtype, seed, block):
    """Key and value pools ``[n_blocks, block, nkv, D]`` of random rows (block 0, the null block, unused) and
    a block table ``[B, S / block]`` giving each session its blocks in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-S // block)
    n_blocks = 1 + B * per
    table = (torch.randperm(n_blocks - 1, generator=gen) + 1).to(torch.int32).view(B, per)
    return (torch.randn(n_blocks, block, nkv, D, generator=gen).to(dtype),
            torch.randn(n_blocks, block, nkv, D, generator=gen).to(dtype), table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("block", [16, 5, 9000])
def test_rope_kv_write_and_attention_kernels(dtype, table, block):
    """The block-table kernels against their CPU references: blocks of 16 (the default), an odd size
    and one block per session (the contiguous layout)."""
    B, nh, nkv, D, S = 3, 32, 4, 128, 9000
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen).to(dtype)
    qn, kn = ((torch.rand(D, generator=gen) + 0.5).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 1023, S - 1])
    keys, values, blocks = _paged(B, S, nkv, D, dtype, 3, block)
    dkeys, dvalues, dblocks = keys.cuda(), values.cuda(), blocks.cuda()
    tables = kv_table(dkeys, dvalues, list(dblocks)).cuda() if table else None
    inv_freq = scaled_inv_freq(D, 1e6, "yarn", 4.0, 4096) if block == 5 else None  # a YaRN model's RoPE
    rope = (inv_freq, 1.1) if inv_freq is not None else (None, 1.0)
    q = rope_kv_write(qkv.cuda(), positions.cuda(), qn.cuda(), kn.cuda(), 1e6, 1e-6, nh, nkv, dkeys, dvalues,
                      None if table else dblocks, tables, None if inv_freq is None else inv_freq.cuda(), rope[1])
    want_q = rope_kv_write(qkv, positions, qn, kn, 1e6, 1e-6, nh, nkv, keys, values, blocks, None, *rope)
    # at position 8999 an ulp of the CPU's inverse frequency moves the angle by ~5e-4 rad: q and k
    # agree with the CPU's to 1e-3 in float32 (test_kernels_cuda compares the RoPE with torch on CUDA)
    rope_tol = max(TOL[dtype], 1e-3)
    assert _rel(q, want_q) <= rope_tol
    assert _rel(dkeys, keys) <= rope_tol and torch.equal(dvalues.cpu(), values)
    out = decode_attention(q, positions.cuda(), dkeys, dvalues, None if table else dblocks, tables)
    want = decode_attention(q.cpu(), positions, dkeys.cpu(), dvalues.cpu(), blocks, None)
    assert _rel(out, want) <= TOL[dtype]


def test_decode_attention_replays_in_a_graph_for_other_block_tables():
    """A captured attention reads whichever pools and block tables the table names at replay, and a
    block table refilled in place (a session that grew) is read as it is at replay."""
    B, nh, nkv, D, S = 2, 8, 2, 64, 300
    q = torch.randn(B, nh, D, device="cuda")
    first, second = _paged(B, S, nkv, D, torch.float32, 4, 16), _paged(B, S, nkv, D, torch.float32, 5, 16)
    first, second = tuple(t.cuda() for t in first), tuple(t.cuda() for t in second)
    positions = torch.tensor([10, 299], device="cuda")
    table = kv_table(first[0], first[1], list(first[2])).cuda()
    decode_attention(q, positions, *first, table)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, positions, *first, table)
    table.copy_(kv_table(second[0], second[1], list(second[2])).cuda())
    positions.copy_(torch.tensor([200, 5]))
    graph.replay()
    want = decode_attention(q.cpu(), positions.cpu(), *(t.cpu() for t in second), None)
    assert _rel(out, want) <= 1e-5
    second[2][0] = second[2][0].flip(0)  # the same table tensors, other blocks
    graph.replay()
    want = decode_attention(q.cpu(), positions.cpu(), *(t.cpu() for t in second), None)
    assert _rel(out, want) <= 1e-5


def _moe_decode_case(where: str, dtype: torch.dtype, qtypes=(T.Q4_K, T.Q4_K, T.Q6_K), **ffn):
    """``moe_decode`` on CUDA (8 experts of 2048 x 768, 3 tokens, top-4; misses staged from a pinned
    arena with ``where == "staged"``), then on the CPU (the reference); ``ffn``: biases and activation."""
    packed, fmt = experts(qtypes, 2048, 768, 8)
    slots = packed.clone()
    T_, k = 3, 4
    expert = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7, 3, 1, 0])
    slot = expert.clone() if where == "resident" else torch.where(expert % 2 == 0, expert, -1)
    x = torch.randn(T_, 2048, generator=torch.Generator().manual_seed(6)).to(dtype)
    weights = torch.rand(T_, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    arena = packed.pin_memory()
    rest = op_args(x, slots, packed, slot, expert, k, fmt)[6:]
    cuda_ffn = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in ffn.items()}
    got = moe_decode(*op_args(x.cuda(), slots.cuda(), arena, slot.cuda(), expert.cuda(), k, fmt)[:5],
                     weights.cuda(), k, *rest, **cuda_ffn)
    want = moe_decode(*op_args(x, slots, packed, slot, expert, k, fmt)[:5], weights, k, *rest, **ffn)
    return got, want


@pytest.mark.parametrize("where", ["resident", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_kernel(where, dtype):
    got, want = _moe_decode_case(where, dtype)
    assert _rel(got, want) <= TOL[dtype]


SPLIT = moe.LaunchConfig(design="split")


@pytest.mark.parametrize("config", [SPLIT, moe.LaunchConfig(design="split", split_k=2, bn_combine=2)],
                         ids=["split", "split2"])
@pytest.mark.parametrize("qtypes", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0,) * 3], ids=lambda q: q[-1].name)
@pytest.mark.parametrize("where", ["resident", "staged"])
def test_moe_decode_split_design_matches_the_reference_and_repeats(config, qtypes, where):
    """The split design (LaunchConfig): within the float32 tolerance, bit-identical when run again."""
    with moe.launched_with(config):
        got, want = _moe_decode_case(where, torch.float32, qtypes)
        assert _rel(got, want) <= TOL[torch.float32]
        assert torch.equal(got, _moe_decode_case(where, torch.float32, qtypes)[0])


@pytest.mark.parametrize("config", [SPLIT, moe.LaunchConfig(design="split", split_k=4, fast_q4k=False, tile=1024)],
                         ids=["split", "split4-decoded"])
def test_moe_split_design_biases_and_rows(config):
    """The split design with swiglu_oai and the experts' biases (gpt-oss), and the uncombined rows of
    ``moe_pair_rows``."""
    with moe.launched_with(config):
        gen = torch.Generator().manual_seed(8)
        biases = dict(gate_bias=torch.randn(8, 768, generator=gen) * 0.1, up_bias=torch.randn(8, 768, generator=gen) * 0.1,
                      down_bias=torch.randn(8, 2048, generator=gen) * 0.1, act=1, alpha=1.702, limit=7.0)
        got, want = _moe_decode_case("staged", torch.float32, (T.Q4_K,) * 3, **biases)
        assert _rel(got, want) <= TOL[torch.float32]
        args, rows_want = _moe_case((T.Q4_K, T.Q4_K, T.Q6_K), 512, 256, torch.float32, "device")
        assert rel(moe.moe_pair_rows(*args), rows_want) < 1e-5
