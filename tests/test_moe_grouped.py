"""The grouped decode MoE design (strata_core/ops/moe_grouped.py, ``LaunchConfig.grouped``) against the
CPU references of ``strata::moe_decode`` / ``moe_pair_rows`` / ``moe_decode_rows``, on CUDA, or on the
CPU under the Triton interpreter:
``TRITON_INTERPRET=1 PYTHONPATH=<a CPU triton> pytest tests/test_moe_grouped.py``.

Tolerance: float32 within a relative (Frobenius) 1e-5. Kernel and reference both sum every product in
float32, in different orders (the kernel in ``kt``-value steps of ``tl.dot``, the reference in its
matmul's): over K <= 2048 terms the two sums differ by a few float32 ulps of the row norm (~sqrt(K) *
6e-8 ~ 3e-6); tf32x3 (the CUDA default) adds ~2**-21 a product. bf16 activations within 2e-2: the
reference rounds g, u, h and each row to bf16, the kernel keeps them in float32 (as the per-pair
kernels' tolerance, tests/test_kernels_cuda.py). Every run is repeated: bit-identical (no atomics,
one order).

On the interpreter the programs take large tiles (its cost is per program and K step), except in the
tests of the tiling itself.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops import moe
from strata_core.ops.gather import gather_experts
from strata_core.ops.qdecode import HAS_TRITON, KERNEL_TYPES
from test_kernels import experts, op_args

if HAS_TRITON:
    from strata_core.ops import moe_grouped, moe_triton

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
DEVICES = [pytest.param("cuda", marks=needs_cuda),
           pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))]
pytestmark = pytest.mark.usefixtures("float_cpu_kernels")  # the kernels' float products against the CPU's
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: gate, up and down types covering every format the kernels decode
TRIPLES = [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0,) * 3, (T.Q5_K, T.Q6_K, T.IQ4_XS), (T.Q2_K, T.Q3_K, T.MXFP4),
           (T.IQ3_XXS, T.IQ3_S, T.Q4_0), (T.Q4_1, T.Q5_0, T.Q5_1), (T.IQ4_NL, T.Q4_K, T.Q4_K)]
HIDDEN, FFN = 256, 256


def grouped(device: str, **fields) -> moe.LaunchConfig:
    """Every window grouped; on the interpreter large tiles (fewer programs and steps)."""
    tiles = dict(bn_grouped=128, kt=256) if device == "cpu" else {}
    return moe.LaunchConfig(**{"grouped": True, "grouped_pairs": 1, **tiles, **fields})


def kernel(op: str, device: str):
    """The Triton kernel of ``op``: the op itself on CUDA; on the CPU its CUDA kernel called on CPU
    tensors (the interpreter runs them)."""
    if device == "cuda":
        return getattr(moe, op)
    if op == "moe_decode":
        return moe_triton.decode_cuda
    fn = moe_triton.decode_rows_cuda if op == "moe_decode_rows" else moe_triton.pair_rows_cuda

    def call(*args, direct_misses=False, gate_bias=None, up_bias=None, down_bias=None, act=0, alpha=1.702,
             limit=7.0):  # these take the FFN arguments positionally
        return fn(*args, gate_bias, up_bias, down_bias, act, alpha, limit, direct_misses=direct_misses)
    return call


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def routing(gen: torch.Generator, tokens: int, k: int, n_experts: int, hot: int) -> torch.Tensor:
    """``[tokens * k]``: each token's k distinct experts (a router's top-k), the first ``hot`` tokens'
    first expert expert 0 (one expert routed from many tokens)."""
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)])  # [T, k]
    for t in range(min(hot, tokens)):
        if not (ids[t] == 0).any():
            ids[t, 0] = 0
    return ids.reshape(-1)


def layer_case(qtypes, tokens: int, k: int, n_experts: int, hot: int, resident: float, seed: int,
               dtype=torch.float32, hidden: int = HIDDEN, ffn: int = FFN):
    """Packed experts, a slot table holding a random ``resident`` share of them (one spare slot, wider
    rows than an expert), the routing, each pair's slot (-1: a miss), ``x`` and routing weights."""
    arena, fmt = experts(qtypes, hidden, ffn, n_experts, seed)
    gen = torch.Generator().manual_seed(seed)
    held = torch.randperm(n_experts, generator=gen)[:round(resident * n_experts)]
    slots = torch.zeros(len(held) + 1, fmt.total + 64, dtype=torch.uint8)
    slots[:len(held), :fmt.total] = arena[held]
    expert = routing(gen, tokens, k, n_experts, hot)
    slot = torch.full_like(expert, -1)
    for i, e in enumerate(held.tolist()):
        slot[expert == e] = i
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype)
    weights = torch.rand(tokens, k, generator=gen)
    return fmt, arena, slots, slot, expert, x, weights


def run(op: str, device: str, where: str, fmt, arena, slots, slot, expert, x, weights, k, **ffn):
    """``op`` through the kernel on ``device``, the misses read as ``where`` says: ``device`` (an arena on
    the device, in place), ``by-pair`` (staged first by ``gather_experts``, ``moe_decode``'s
    ``staged``), ``pinned`` / ``direct`` (a pinned host arena, staged by the op / read zero-copy)."""
    dev = torch.device(device)
    on = {n: v.to(dev) if isinstance(v, torch.Tensor) else v for n, v in ffn.items()}
    src = arena.pin_memory() if where in ("pinned", "direct") else arena.to(dev)
    if where == "by-pair":
        src = gather_experts(slots.to(dev), src, slot.to(dev), expert.to(dev), fmt.total, True)
        on["staged"] = True
    args = op_args(x.to(dev), slots.to(dev), src, slot.to(dev), expert.to(dev), k, fmt)
    if op == "moe_decode":
        args = (*args[:5], weights.to(dev), *args[5:])
    return kernel(op, device)(*args, direct_misses=where == "direct", **on)


def reference(op: str, fmt, arena, slots, slot, expert, x, weights, k, **ffn):
    args = op_args(x, slots, arena, slot, expert, k, fmt)
    if op == "moe_decode":
        args = (*args[:5], weights, *args[5:])
    return getattr(moe, op)(*args, **ffn)


def test_the_triples_cover_every_kernel_format():
    assert {q for triple in TRIPLES for q in triple} == set(KERNEL_TYPES)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25)
@given(P=st.integers(1, 640), n_experts=st.integers(1, 300), bm=st.sampled_from([16, 32]), seed=st.integers(0, 999))
def test_align_sorts_the_pairs_by_expert_into_padded_blocks(device, P, n_experts, bm, seed):
    """Each expert's pairs (ascending experts, pair order within one) from a multiple of ``bm`` rows,
    padded with P to the next; ``total`` the rows in use, within the static bound."""
    expert = torch.randint(0, n_experts, (P,), generator=torch.Generator().manual_seed(seed))
    sorted_, total = moe_grouped.align(expert.to(device), bm, n_experts)
    want = []
    for e in torch.unique(expert).tolist():
        pairs = torch.nonzero(expert == e).flatten().tolist()
        want += pairs + [P] * (-len(pairs) % bm)
    assert int(total) == len(want) <= sorted_.numel() == bm * (P // bm + min(P, n_experts))
    assert sorted_[:len(want)].tolist() == want


WHERE = {"cuda": ["device", "by-pair", "pinned", "direct"], "cpu": ["device", "by-pair"]}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12 if INTERPRET else 40)
@given(data=st.data(), tokens=st.integers(1, 64), k=st.integers(1, 8), extra=st.integers(0, 8),
       hot=st.integers(0, 64), resident=st.sampled_from([0.0, 0.5, 1.0]), triple=st.sampled_from(TRIPLES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_grouped_rows_match_the_reference_and_repeat(device, data, tokens, k, extra, hot, resident, triple,
                                                     dtype, seed):
    """Random routings (B in 1..64 tokens, top-k of k + ``extra`` experts, expert 0 routed from ``hot``
    tokens), any share of misses read any way, every format: each op within the tolerance of its
    reference, and bit-identical when run again."""
    op = data.draw(st.sampled_from(["moe_decode", "moe_pair_rows", "moe_decode_rows"]))
    where = data.draw(st.sampled_from(WHERE[device] if op == "moe_decode" else
                                      [w for w in WHERE[device] if w != "by-pair"]))
    case = layer_case(triple, tokens, k, k + extra, hot, resident, seed, dtype)
    want = reference(op, *case, k)
    with moe.launched_with(grouped(device)):
        got = run(op, device, where, *case, k)
        again = run(op, device, where, *case, k)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel(got, want) < TOL[dtype]
    assert torch.equal(got, again)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triple", TRIPLES, ids=lambda q: "-".join(t.name for t in q))
def test_grouped_decodes_every_format(device, triple):
    """Each format as gate, up or down, an expert routed from several tokens, half the experts missed."""
    case = layer_case(triple, 6, 2, 4, 6, 0.5, 2)
    want = reference("moe_decode", *case, 2)
    with moe.launched_with(grouped(device)):
        got = run("moe_decode", device, "device", *case, 2)
    assert rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["moe_decode", "moe_pair_rows", "moe_decode_rows"])
def test_grouped_biases_and_swiglu_oai(device, op):
    """gpt-oss: MXFP4 experts with gate, up and down biases and swiglu_oai."""
    case = layer_case((T.MXFP4,) * 3, 12, 4, 8, 6, 0.5, 3)
    gen = torch.Generator().manual_seed(4)
    ffn = dict(gate_bias=torch.randn(8, FFN, generator=gen) * 0.1, up_bias=torch.randn(8, FFN, generator=gen) * 0.1,
               down_bias=torch.randn(8, HIDDEN, generator=gen) * 0.1, act=1, alpha=1.702, limit=7.0)
    want = reference(op, *case, 4, **ffn)
    with moe.launched_with(grouped(device)):
        got = run(op, device, "device", *case, 4, **ffn)
    assert rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtypes, hidden, ffn, bn, kt", [((T.Q4_K, T.Q4_K, T.Q6_K), 256, 256, 128, 32),
                                                        ((T.Q8_0, T.Q4_0, T.Q8_0), 96, 160, 64, 64)],
                         ids=["steps", "partial-tiles"])
def test_grouped_tiling(device, qtypes, hidden, ffn, bn, kt):
    """Many K steps of small tiles, and shapes whose rows and K fill neither an output tile nor a step."""
    case = layer_case(qtypes, 9, 3, 4, 9, 0.5, 5, hidden=hidden, ffn=ffn)
    want = reference("moe_decode", *case, 3)
    with moe.launched_with(grouped(device, bn_grouped=bn, kt=kt)):
        got = run("moe_decode", device, "device", *case, 3)
    assert rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast, kt", [(True, 64), (True, 512), (False, 64)],
                         ids=["16-byte", "16-byte-past-K", "decoded"])
def test_grouped_q4_k_both_ways(device, fast, kt):
    """Q4_K read as 16-byte loads of its nibbles (``fast_q4k``, aligned rows; a step longer than K too)
    and decoded value by value."""
    case = layer_case((T.Q4_K,) * 3, 6, 4, 5, 6, 0.5, 10)
    want = reference("moe_decode", *case, 4)
    with moe.launched_with(grouped(device, fast_q4k=fast, kt=kt)):
        got = run("moe_decode", device, "device", *case, 4)
    assert rel(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", moe.DOT_PRECISIONS)
def test_grouped_dot_precisions(device, precision):
    """``dot_precision``: ieee and tf32x3 within the float32 tolerance, tf32 and bf16 within bf16's (on
    CUDA; the interpreter ignores the precision and multiplies bf16 operands as their bits)."""
    if device == "cpu" and precision == "bf16":
        pytest.skip("the Triton interpreter's dot of bf16 operands is wrong")
    case = layer_case((T.Q4_K, T.Q4_K, T.Q6_K), 8, 4, 6, 8, 1.0, 6)
    want = reference("moe_decode", *case, 4)
    with moe.launched_with(grouped(device, dot_precision=precision)):
        got = run("moe_decode", device, "device", *case, 4)
    assert rel(got, want) < (TOL[torch.float32] if precision in ("ieee", "tf32x3") else TOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
def test_the_pair_count_picks_the_design(device):
    """Below ``grouped_pairs`` the per-pair kernels run (the output of ``grouped=False``, bit for bit), from
    it the grouped ones (the output of ``grouped_pairs=1``)."""
    config = grouped(device, grouped_pairs=8)
    for tokens, design in ((1, dict(grouped=False)), (2, dict(grouped_pairs=1))):
        case = layer_case((T.Q8_0,) * 3, tokens, 4, 6, 0, 0.5, 7, hidden=64, ffn=64)
        with moe.launched_with(config):
            got = run("moe_decode", device, "device", *case, 4)
        with moe.launched_with(grouped(device, **design)):
            assert torch.equal(got, run("moe_decode", device, "device", *case, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_peer_rows_merge_bit_for_bit(device, seed):
    """A peer's grouped rows (``moe_decode_rows``) taken in place of the home's (``served``) give the
    output of one device holding every expert, bit for bit: a pair's row does not depend on which
    other pairs share its block."""
    fmt, arena, _, _, expert, x, weights = layer_case((T.Q4_K, T.Q4_K, T.Q6_K), 16, 4, 10, 8, 1.0, seed)
    dev = torch.device(device)
    everything = arena.to(dev)  # slot e holds expert e
    home, peer = torch.zeros_like(everything[:5]), torch.zeros_like(everything[:5])  # slot 4: a zero slot
    home[:4], peer[:4] = everything[:4], everything[4:8]
    x, weights, expert, src = x.to(dev), weights.to(dev), expert.to(dev), arena.to(dev)
    on_peer = (expert >= 4) & (expert < 8)
    with moe.launched_with(grouped(device)):
        decode, rows = kernel("moe_decode", device), kernel("moe_decode_rows", device)
        single = decode(*op_args(x, everything, src, expert, expert, 4, fmt)[:5], weights,
                        *op_args(x, everything, src, expert, expert, 4, fmt)[5:])
        peer_rows = rows(*op_args(x, peer, src, torch.where(on_peer, expert - 4, 4), expert, 4, fmt))
        home_slot = torch.where(expert < 4, expert, torch.where(on_peer, 4, -1))  # 8, 9: misses
        home_args = op_args(x, home, src, home_slot, expert, 4, fmt)
        got = decode(*home_args[:5], weights, *home_args[5:], served=on_peer, served_rows=peer_rows)
    assert torch.equal(got, single)


@needs_cuda
def test_grouped_replays_in_a_cuda_graph_with_new_routing():
    """Static shapes for P pairs, no host read: one capture serves every routing."""
    fmt, arena, _, slot, expert, x, weights = layer_case((T.Q4_K, T.Q4_K, T.Q6_K), 8, 4, 12, 4, 0.5, 8)
    dev = torch.device("cuda")
    slots = arena.to(dev)  # slot e holds expert e; experts from 6 on are read as misses
    args = op_args(x.to(dev), slots, arena.to(dev), torch.where(expert < 6, expert, -1).to(dev), expert.to(dev), 4,
                   fmt)
    args = (*args[:5], weights.to(dev), *args[5:])
    with moe.launched_with(grouped("cuda")):
        moe.moe_decode(*args)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.moe_decode(*args)
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            expert_now = routing(gen, 8, 4, 12, seed * 3)
            args[4].copy_(expert_now)
            args[3].copy_(torch.where(expert_now < 6, expert_now, -1))
            args[0].copy_(torch.randn(x.shape, generator=gen))
            graph.replay()
            torch.testing.assert_close(out, moe.moe_decode(*args), rtol=0, atol=0)


@needs_cuda
def test_opcheck_grouped_decode():
    fmt, arena, slots, slot, expert, x, weights = layer_case((T.Q4_K, T.Q4_K, T.Q6_K), 8, 4, 8, 4, 0.5, 9,
                                                             torch.bfloat16)
    dev = torch.device("cuda")
    args = op_args(x.to(dev), slots.to(dev), arena.to(dev), slot.to(dev), expert.to(dev), 4, fmt)
    with moe.launched_with(grouped("cuda")):
        torch.library.opcheck(torch.ops.strata.moe_decode.default, (*args[:5], weights.to(dev), *args[5:]))
        torch.library.opcheck(torch.ops.strata.moe_pair_rows.default, args)


@pytest.mark.parametrize("fields", [dict(dot_precision="fp16"), dict(bm=8), dict(kt=16), dict(bn_grouped=48),
                                    dict(grouped_pairs=0)], ids=str)
def test_launch_config_rejects_grouped_fields_the_kernels_cannot_take(fields):
    with pytest.raises(ValueError):
        moe.LaunchConfig(**fields)
