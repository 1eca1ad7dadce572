"""The fused decode ops' CUDA kernels against their CPU references (strata_core/ops/decode.py,
``strata::moe_decode``); runs where CUDA exists (the GPU machine)."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.ops.decode import add_rms_norm, decode_attention, kv_table, rope_kv_write, route_topk
from strata_core.ops.moe import moe_decode
from test_kernels import experts, op_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

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


def _caches(B, S, nkv, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(S, nkv, D, generator=gen).to(dtype) for _ in range(B)],
            [torch.randn(S, nkv, D, generator=gen).to(dtype) for _ in range(B)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", [False, True])
def test_rope_kv_write_and_attention_kernels(dtype, table):
    B, nh, nkv, D, S = 3, 32, 4, 128, 9000
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen).to(dtype)
    qn, kn = ((torch.rand(D, generator=gen) + 0.5).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 1023, S - 1])
    keys, values = _caches(B, S, nkv, D, dtype, 3)
    dkeys, dvalues = [k.cuda() for k in keys], [v.cuda() for v in values]
    tables = kv_table(dkeys, dvalues).cuda() if table else None
    q = rope_kv_write(qkv.cuda(), positions.cuda(), qn.cuda(), kn.cuda(), 1e6, 1e-6, nh, nkv, dkeys, dvalues, tables)
    want_q = rope_kv_write(qkv, positions, qn, kn, 1e6, 1e-6, nh, nkv, keys, values, None)
    # at position 8999 an ulp of the CPU's inverse frequency moves the angle by ~5e-4 rad: q and k
    # agree with the CPU's to 1e-3 in float32 (test_kernels_cuda compares the RoPE with torch on CUDA)
    rope_tol = max(TOL[dtype], 1e-3)
    assert _rel(q, want_q) <= rope_tol
    for got_k, want_k, got_v, want_v in zip(dkeys, keys, dvalues, values):
        assert _rel(got_k, want_k) <= rope_tol and torch.equal(got_v.cpu(), want_v)
    out = decode_attention(q, positions.cuda(), dkeys, dvalues, tables)
    want = decode_attention(q.cpu(), positions, [k.cpu() for k in dkeys], [v.cpu() for v in dvalues], None)
    assert _rel(out, want) <= TOL[dtype]


def test_decode_attention_replays_in_a_graph_for_other_caches():
    """A captured attention reads whichever caches the table names at replay."""
    B, nh, nkv, D, S = 2, 8, 2, 64, 300
    q = torch.randn(B, nh, D, device="cuda")
    first, second = _caches(B, S, nkv, D, torch.float32, 4), _caches(B, S, nkv, D, torch.float32, 5)
    first = tuple([t.cuda() for t in part] for part in first)
    second = tuple([t.cuda() for t in part] for part in second)
    positions = torch.tensor([10, 299], device="cuda")
    table = kv_table(*first).cuda()
    decode_attention(q, positions, *first, table)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, positions, *first, table)
    table.copy_(kv_table(*second).cuda())
    positions.copy_(torch.tensor([200, 5]))
    graph.replay()
    want = decode_attention(q.cpu(), positions.cpu(), *([t.cpu() for t in part] for part in second), None)
    assert _rel(out, want) <= 1e-5


@pytest.mark.parametrize("where", ["resident", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_kernel(where, dtype):
    packed, fmt = experts((T.Q4_K, T.Q4_K, T.Q6_K), 2048, 768, 8)
    slots = torch.zeros(8, packed.shape[1], dtype=torch.uint8)
    slots[:8] = packed
    T_, k = 3, 4
    expert = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7, 3, 1, 0])
    slot = expert.clone() if where == "resident" else torch.where(expert % 2 == 0, expert, -1)
    x = torch.randn(T_, 2048, generator=torch.Generator().manual_seed(6)).to(dtype)
    weights = torch.rand(T_, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    arena = packed.pin_memory()
    got = moe_decode(*op_args(x.cuda(), slots.cuda(), arena, slot.cuda(), expert.cuda(), k, fmt)[:5],
                     weights.cuda(), k, *op_args(x, slots, packed, slot, expert, k, fmt)[6:])
    want = moe_decode(*op_args(x, slots, packed, slot, expert, k, fmt)[:5], weights,
                      *op_args(x, slots, packed, slot, expert, k, fmt)[5:])
    assert _rel(got, want) <= TOL[dtype]
