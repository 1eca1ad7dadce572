"""The fused decode ops (strata_core/ops/decode.py, ``strata::moe_decode``): CPU references, fakes, opcheck.

The CUDA kernels are compared with these references in tests/test_decode_ops_cuda.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.model.ops import apply_rope, rms_norm, rope_cos_sin
from strata_core.model.rope import scaled_inv_freq
from strata_core.ops import decode
from strata_core.ops.decode import add_rms_norm, decode_attention, kv_table, rope_kv_write, route_topk
from strata_core.ops.moe import moe_decode, moe_pair_rows
from test_kernels import experts, op_args

pytestmark = pytest.mark.usefixtures("one_thread")


def test_add_rms_norm_is_the_sum_then_the_norm():
    gen = torch.Generator().manual_seed(0)
    h, d, w = torch.randn(3, 48, generator=gen), torch.randn(3, 48, generator=gen), torch.rand(48, generator=gen) + 0.5
    total, normed = add_rms_norm(h, d, w, 1e-6)
    assert torch.equal(total, h + d) and torch.equal(normed, rms_norm(h + d, w, 1e-6))
    torch.library.opcheck(torch.ops.strata.add_rms_norm.default, (h, d, w, 1e-6))


@pytest.mark.parametrize("norm, scale", [(True, 1.0), (False, 2.5)])
def test_route_topk_picks_the_largest_probabilities(norm, scale):
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    ids, weights = route_topk(logits, 4, norm, scale, 6e-5)
    probs = torch.softmax(logits, -1)
    assert ids.dtype == torch.int64 and ids.shape == (5, 4)
    picked = probs.gather(1, ids)
    assert torch.all(picked[:, :-1] >= picked[:, 1:])  # largest first
    assert torch.all(picked[:, -1:] >= probs.scatter(1, ids, -1.0).max(-1, keepdim=True).values)
    want = (picked / picked.sum(-1, keepdim=True) if norm else picked) * scale
    torch.testing.assert_close(weights, want)
    torch.library.opcheck(torch.ops.strata.route_topk.default, (logits, 4, norm, scale, 6e-5))


def _paged(B: int, S: int, nkv: int, D: int, seed: int, block: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key and value pools ``[n_blocks, block, nkv, D]`` of random rows and a block table ``[B, S / block]``
    giving each session its own blocks in a shuffled order (block 0, the null block, unused)."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-S // block)
    n_blocks = 1 + B * per
    table = (torch.randperm(n_blocks - 1, generator=gen) + 1).to(torch.int32).view(B, per)
    return (torch.randn(n_blocks, block, nkv, D, generator=gen), torch.randn(n_blocks, block, nkv, D, generator=gen),
            table)


def _rows(pool: torch.Tensor, table: torch.Tensor, b: int) -> torch.Tensor:
    """Session b's rows ``[S, nkv, D]`` in position order."""
    return pool[table[b].long()].flatten(0, 1)


def test_rope_kv_write_writes_each_session_at_its_position():
    B, nh, nkv, D, S = 3, 4, 2, 16, 12
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen)
    qn, kn = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    positions = torch.tensor([0, 7, 11])
    keys, values, table = _paged(B, S, nkv, D, 3)
    before = keys.clone()
    q = rope_kv_write(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, keys, values, table, None)
    assert q.shape == (B, nh, D)
    for b, p in enumerate(positions.tolist()):
        v = qkv[b, (nh + nkv) * D:].view(nkv, D)
        assert torch.equal(_rows(values, table, b)[p], v)
        assert not torch.equal(_rows(keys, table, b)[p], _rows(before, table, b)[p])
        untouched = torch.arange(S) != p
        assert torch.equal(_rows(keys, table, b)[untouched], _rows(before, table, b)[untouched])
        # position 0 rotates by nothing: q is the normed input
        if p == 0:
            torch.testing.assert_close(q[b], rms_norm(qkv[b, :nh * D].view(nh, D), qn, 1e-6))
    assert torch.equal(keys[0], before[0])  # the null block is never written
    torch.library.opcheck(torch.ops.strata.rope_kv_write.default,
                          (qkv, positions, qn, None, 1e4, 1e-6, nh, nkv, *_paged(B, S, nkv, D, 4), None))


def test_rope_kv_write_applies_a_scaled_rope():
    """With a YaRN table and attention factor, q and the written k are rotated by them (as the eager
    path's ``rope_cos_sin`` + ``apply_rope``), not by the plain frequencies of theta."""
    B, nh, nkv, D, S = 2, 4, 2, 16, 9000
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen)
    positions = torch.tensor([5, 8191])
    inv_freq, mscale = scaled_inv_freq(D, 1e4, "yarn", 4.0, 2048), 1.25
    keys, values, table = _paged(B, S, nkv, D, 3, 512)
    q = rope_kv_write(qkv, positions, None, None, 1e4, 1e-6, nh, nkv, keys, values, table, None, inv_freq, mscale)
    cos, sin = rope_cos_sin(positions, D, 1e4, inv_freq, mscale)
    torch.testing.assert_close(q, apply_rope(qkv[:, :nh * D].view(B, nh, D), cos, sin), rtol=0, atol=0)
    k = apply_rope(qkv[:, nh * D:(nh + nkv) * D].view(B, nkv, D), cos, sin)
    for b, p in enumerate(positions.tolist()):
        assert torch.equal(_rows(keys, table, b)[p], k[b])
    plain = rope_kv_write(qkv, positions, None, None, 1e4, 1e-6, nh, nkv, *_paged(B, S, nkv, D, 3, 512), None)
    assert not torch.allclose(q, plain)


@pytest.mark.parametrize("block", [1, 3, 4, 16])
def test_decode_attention_attends_causally_over_each_sessions_blocks(block):
    B, nh, nkv, D, S = 2, 4, 2, 16, 10
    q = torch.randn(B, nh, D, generator=torch.Generator().manual_seed(5))
    keys, values, table = _paged(B, S, nkv, D, 6, block)
    positions = torch.tensor([3, 9])
    out = decode_attention(q, positions, keys, values, table, None)
    for b, p in enumerate(positions.tolist()):
        k = _rows(keys, table, b)[:p + 1].repeat_interleave(nh // nkv, dim=1).transpose(0, 1)  # [nh, S, D]
        v = _rows(values, table, b)[:p + 1].repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v)  # [nh, 1, D]
        torch.testing.assert_close(out[b], want.reshape(-1))
    garbage = keys.clone()
    garbage[table[0, 4 // block + 1:].long()] = 1e4  # rows after a session's position are never read
    garbage[table[0, 4 // block].long(), 4 % block:] = 1e4
    garbage[0] = 1e4  # nor the null block
    assert torch.equal(decode_attention(q, positions, garbage, values, table, None), out)
    torch.library.opcheck(torch.ops.strata.decode_attention.default, (q, positions, keys, values, table, None))


def test_paged_decode_ops_match_contiguous_caches_bit_for_bit():
    """One block per session (block = the capacity) is the contiguous cache: the same bits whatever the block size."""
    B, nh, nkv, D, S = 3, 4, 2, 16, 12
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(B, nh, D, generator=gen)
    positions = torch.tensor([2, 11, 6])
    keys, values, table = _paged(B, S, nkv, D, 10, block=3)
    whole = [_rows(t, table, b)[None] for t in (keys, values) for b in range(B)]
    contiguous = (torch.cat([torch.zeros(1, S, nkv, D)] + whole[:B]), torch.cat([torch.zeros(1, S, nkv, D)] + whole[B:]),
                  torch.arange(1, B + 1, dtype=torch.int32)[:, None])
    assert torch.equal(decode_attention(q, positions, keys, values, table, None),
                       decode_attention(q, positions, *contiguous, None))


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" and decode.HAS_TRITON),
                    reason="needs TRITON_INTERPRET=1 and a CPU Triton (on CUDA: tests/test_decode_ops_cuda.py)")
@pytest.mark.parametrize("block", [1, 5, 16, 80])
@pytest.mark.parametrize("scaled", [False, True], ids=["rope", "yarn"])
def test_block_table_kernels_match_the_references_under_the_interpreter(block, scaled):
    """The Triton kernels of rope_kv_write and decode_attention, run by Triton's interpreter on CPU
    tensors through an address table: what they write and attend equals the references', with plain
    RoPE and with a YaRN table and attention factor."""
    B, nh, nkv, D, S = 3, 8, 2, 32, 70
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen)
    qn, kn = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    positions = torch.tensor([0, 33, S - 1])
    keys, values, blocks = _paged(B, S, nkv, D, 3, block)
    got_keys, got_values = keys.clone(), values.clone()
    table = kv_table(got_keys, got_values, list(blocks))
    rope = (scaled_inv_freq(D, 1e4, "yarn", 4.0, 32), 1.25) if scaled else (None, 1.0)
    q = decode._rope_kv_cuda(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, got_keys, got_values, None, table, *rope)
    want_q = rope_kv_write(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, keys, values, blocks, None, *rope)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_keys, keys, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_values, values)
    out = decode._attention_cuda(q, positions, got_keys, got_values, None, table)
    torch.testing.assert_close(out, decode_attention(q, positions, got_keys, got_values, blocks, None),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not decode.HAS_TRITON, reason="needs Triton")
def test_the_kernels_refuse_a_pool_that_is_not_16_byte_aligned():
    """The CUDA kernels load and store pool rows 16 bytes at a time: a pool at another address (a view into
    a larger tensor) is a clear error before any launch, for the bf16 and the quantized pools alike."""
    from strata_core.ops import decode_q

    B, nh, nkv, D = 1, 4, 2, 16
    keys, values, blocks = _paged(B, 8, nkv, D, 4)
    shifted = torch.empty(keys.numel() + 1)[1:].view(keys.shape)  # 4 bytes past an aligned allocation
    q, positions = torch.randn(B, nh, D), torch.tensor([5])
    with pytest.raises(ValueError, match="16-byte aligned"):
        decode._attention_cuda(q, positions, keys, shifted, blocks, None)
    with pytest.raises(ValueError, match="16-byte aligned"):
        decode._rope_kv_cuda(torch.randn(B, (nh + 2 * nkv) * D), positions, None, None, 1e4, 1e-6, nh, nkv, shifted,
                             values, blocks, None)
    codes = torch.zeros(keys.shape, dtype=torch.int8)
    scales = torch.ones(*keys.shape[:3], 1)
    shifted_codes = torch.empty(codes.numel() + 8, dtype=torch.int8)[8:].view(codes.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        decode_q._attention_q_cuda(q, positions, shifted_codes, codes, scales, scales.clone(), blocks, None)


def test_kv_table_holds_the_pool_and_block_table_addresses():
    keys, values, table = _paged(2, 4, 1, 16, 7)
    assert kv_table(keys, values, list(table)).tolist() == [
        [keys.data_ptr(), values.data_ptr(), row.data_ptr()] for row in table]


def test_moe_decode_is_the_combined_pair_rows():
    packed, fmt = experts((T.Q4_K, T.Q8_0, T.Q6_K), 256, 64, 6)
    slots = torch.zeros(4, packed.shape[1], dtype=torch.uint8)
    slots[:3] = packed[:3]
    expert = torch.tensor([0, 4, 2, 5, 1, 3])
    slot = torch.where(expert < 3, expert, -1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(9))
    args = op_args(x, slots, packed, slot, expert, 2, fmt)
    rows = moe_pair_rows(*args).view(3, 2, -1)
    got = moe_decode(*args[:5], weights, *args[5:])
    assert torch.equal(got, (rows * weights[..., None]).sum(1))
    torch.library.opcheck(torch.ops.strata.moe_decode.default, (*args[:5], weights, *args[5:]))
