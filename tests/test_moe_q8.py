"""The q8 decode MoE design (strata_core/ops/moe_q8.py, ``LaunchConfig(design="q8")``: Q4_K dotted with
int8 activations by dp4a) against the CPU references of ``strata::moe_decode`` / ``moe_pair_rows`` /
``moe_decode_rows``, on CUDA, or on the CPU under the Triton interpreter (which runs dp4a's sums in integer
ops): ``TRITON_INTERPRET=1 PYTHONPATH=<a CPU triton> pytest tests/test_moe_q8.py``.

Tolerance: bf16 activations within a relative (Frobenius) 2e-2, as the other designs': quantizing a
block of 32 activations to int8 errs by at most half a step of ``max |v| / 127`` a value (~0.2% of a
block's largest), far inside it. Float32 activations take the split design (its float32 tolerance).
Every run is repeated: bit-identical.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.ops import moe
from strata_core.ops.qdecode import HAS_TRITON
from test_moe_grouped import DEVICES, layer_case, reference, rel, run

if HAS_TRITON:
    from strata_core.ops.moe_q8 import quantize_q8

TOL = 2e-2
#: the references' own products in float (an int8 CPU body, on a VNNI host, would add its rounding to the q8's)
pytestmark = pytest.mark.usefixtures("float_cpu_kernels")
#: all Q4_K (every launch q8), a Q6_K down (the split design's down after a q8 gate_up), no Q4_K at all
TRIPLES = [(T.Q4_K,) * 3, (T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_K, T.Q4_K)]


def q8(device: str, **fields) -> moe.LaunchConfig:
    """Every window q8; on the interpreter a program takes whole rows (its cost is per program and step)."""
    tiles = dict(bn_gate_up=256, bn_down=256, bn_combine=256, tile=65536) if device == "cpu" else {}
    return moe.LaunchConfig(**{"design": "q8", "q8_pairs": 1, **tiles, **fields})


def kernels(device: str):
    """``moe_decode`` and ``moe_decode_rows`` on ``device``: the ops on CUDA, their CUDA kernels on CPU tensors
    under the interpreter."""
    if device == "cuda":
        return moe.moe_decode, moe.moe_decode_rows
    from strata_core.ops import moe_triton
    return moe_triton.decode_cuda, moe_triton.decode_rows_cuda


@settings(max_examples=40, deadline=None)
@given(data=st.data(), tokens=st.integers(1, 40), k=st.integers(1, 8), extra=st.integers(0, 8),
       resident=st.sampled_from([0.0, 0.5, 1.0]), triple=st.sampled_from(TRIPLES),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 999))
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
def test_q8_rows_match_the_reference_and_repeat(data, tokens, k, extra, resident, triple, dtype, seed):
    """Random routings, any share of misses read any way, each op within the tolerance of its reference
    and bit-identical when run again."""
    op = data.draw(st.sampled_from(["moe_decode", "moe_pair_rows", "moe_decode_rows"]))
    where = data.draw(st.sampled_from(["device", "by-pair", "pinned", "direct"] if op == "moe_decode" else
                                      ["device", "pinned", "direct"]))
    case = layer_case(triple, tokens, k, k + extra, tokens, resident, seed, dtype)
    want = reference(op, *case, k)
    with moe.launched_with(q8("cuda")):
        got = run(op, "cuda", where, *case, k)
        again = run(op, "cuda", where, *case, k)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel(got, want) < TOL
    assert torch.equal(got, again)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("tile", [256, 4096, 65536], ids=["block-a-step", "default", "row-a-step"])
def test_q8_engine_shapes_and_steps(tile):
    """The 30B's shapes (K 2048 for gate_up, 768 = 3 blocks for down: a step of 4 blocks masks one), with
    one block a step, the default and a whole row a step."""
    case = layer_case((T.Q4_K,) * 3, 8, 8, 32, 4, 1.0, 7, torch.bfloat16, hidden=2048, ffn=768)
    want = reference("moe_decode", *case, 8)
    with moe.launched_with(q8("cuda", tile=tile)):
        got = run("moe_decode", "cuda", "device", *case, 8)
    assert rel(got, want) < TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["moe_decode", "moe_pair_rows", "moe_decode_rows"])
def test_q8_biases_and_swiglu_oai(op, device):
    """gpt-oss's biases and swiglu_oai on Q4_K experts."""
    case = layer_case((T.Q4_K,) * 3, 12, 4, 8, 6, 0.5, 3, torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    ffn = dict(gate_bias=torch.randn(8, 256, generator=gen) * 0.1, up_bias=torch.randn(8, 256, generator=gen) * 0.1,
               down_bias=torch.randn(8, 256, generator=gen) * 0.1, act=1, alpha=1.702, limit=7.0)
    want = reference(op, *case, 4, **ffn)
    with moe.launched_with(q8(device)):
        got = run(op, device, "device", *case, 4, **ffn)
    assert rel(got, want) < TOL


@pytest.mark.parametrize("device", DEVICES)
def test_q8_served_rows_merge_bit_for_bit(device):
    """Rows of ``moe_decode_rows`` taken in place of some pairs' own give ``moe_decode``'s output exactly
    (a peer tier's rows join the home's combination)."""
    fmt, arena, slots, slot, expert, x, weights = layer_case((T.Q4_K,) * 3, 6, 4, 8, 6, 1.0, 9, torch.bfloat16)
    dev = torch.device(device)
    args = [t.to(dev) for t in (x, slots, arena, slot, expert)]
    op = ([int(q) for q in fmt.qtypes], [n for s in fmt.shapes for n in s], list(fmt.nbytes))
    decode, decode_rows = kernels(device)
    with moe.launched_with(q8(device)):
        plain = decode(*args, weights.to(dev), 4, *op)
        rows = decode_rows(*args, 4, *op)
        served = (torch.arange(slot.numel(), device=dev) % 3 == 0)
        merged = decode(*args, weights.to(dev), 4, *op, served=served, served_rows=rows)
    assert torch.equal(plain, merged)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_activations_take_the_split_design(device):
    """The q8 design keeps out of float32 activations: their output is the split design's, bit for bit."""
    case = layer_case((T.Q4_K,) * 3, 5, 4, 8, 5, 1.0, 12)
    with moe.launched_with(q8(device)):
        got = run("moe_decode", device, "device", *case, 4)
    with moe.launched_with(dataclasses.replace(q8(device), design="split")):
        split = run("moe_decode", device, "device", *case, 4)
    assert torch.equal(got, split)


@pytest.mark.parametrize("device", DEVICES)
def test_the_pair_count_picks_the_design(device):
    """Below ``q8_pairs`` the split design runs (its output bit for bit), from it the q8 design (the
    output of ``q8_pairs=1``)."""
    config = q8(device, q8_pairs=8)
    for tokens, design in ((1, dataclasses.replace(config, design="split")), (2, q8(device))):
        case = layer_case((T.Q4_K,) * 3, tokens, 4, 8, tokens, 1.0, 13, torch.bfloat16)
        with moe.launched_with(config):
            got = run("moe_decode", device, "device", *case, 4)
        with moe.launched_with(design):
            want = run("moe_decode", device, "device", *case, 4)
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_q8_blocks(dtype, device):
    """Codes within half a step of each value, scales ``max |v| / 127``, sums of the values; an all-zero
    block has scale 0 and codes 0."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 512, generator=gen) * torch.logspace(-3, 2, 512)).to(dtype)
    x[1, 64:96] = 0
    words, d, s = quantize_q8(x.to(device))
    q = words.view(torch.int8).cpu().float().view(3, 16, 32)
    v = x.float().view(3, 16, 32)
    amax = v.abs().amax(2)
    assert torch.allclose(d.cpu(), amax / 127)
    assert torch.allclose(s.cpu(), v.sum(2), rtol=1e-5, atol=1e-5)
    assert q.abs().max() <= 127
    step = (amax / 127)[..., None]
    assert ((q * step - v).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all()
    assert (q[1, 2] == 0).all() and d[1, 2] == 0
