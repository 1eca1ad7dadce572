"""``strata::q8_linear`` (strata_core/ops/dense_q8.py): the repacked Q8_0 layout against gguf-py's
dequantizer, the CPU reference against ``linear`` on the dequantized matrix, and the Triton kernel
against the reference within the documented tolerance (float32: 1e-5 of the largest output; bf16:
1e-2, one rounding of the output) on CUDA, or on the CPU under the Triton interpreter:
``TRITON_INTERPRET=1 PYTHONPATH=<a CPU triton> pytest tests/test_dense_q8.py``."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from strata_core.engine import Engine
from strata_core.model import fused_decode, weights as weights_module
from strata_core.runtime.session import DecodeBatch
from strata_core.ops import dense_q8
from strata_core.ops.dense_q8 import Q8Config, Q8Matrix, Q8RowsConfig, q8_bytes, q8_linear, repack_q8_0
from strata_core.ops.matmul import linear
from strata_core.quant import random_blocks
from test_cuda_graphs import _decode

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and dense_q8.HAS_TRITON),
                                reason="needs CUDA and Triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and dense_q8.HAS_TRITON
KERNEL_DEVICES = [pytest.param("cuda", marks=needs_cuda),
                  pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _q8(N: int, K: int, seed: int) -> tuple[torch.Tensor, Q8Matrix]:
    """Random Q8_0 bytes of an ``[N, K]`` matrix and their repacked matrix."""
    raw = torch.from_numpy(random_blocks(T.Q8_0, N * K // 32, np.random.default_rng(seed))).reshape(-1)
    return raw, repack_q8_0(raw, (N, K))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("N, K", [(1, 32), (37, 96), (5, 2048)])
def test_repack_round_trips_to_the_reference_dequantization(N, K):
    """Every value of the repacked matrix is gguf-py's value of the block it came from, bit for bit;
    the codes and scales hold the blocks' bytes and the matrix takes the GGUF's bytes."""
    raw, m = _q8(N, K, N * K)
    want = quants.dequantize(raw.numpy(), T.Q8_0).reshape(N, K)
    assert m.codes.dtype == torch.int8 and m.scales.dtype == torch.float16
    assert m.codes.is_contiguous() and m.scales.is_contiguous() and m.shape == (N, K)
    assert torch.equal(m.dequantize(), torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))
    blocks = raw.view(-1, 34)
    assert torch.equal(m.codes.view(torch.uint8).reshape(-1, 32), blocks[:, 2:])
    assert torch.equal(m.scales.reshape(-1, 1).view(torch.uint8), blocks[:, :2])
    assert m.nbytes == raw.numel() == q8_bytes((N, K))


def test_cat_and_split_keep_the_rows():
    parts = [_q8(n, 64, n)[1] for n in (3, 5, 2)]
    whole = Q8Matrix.cat(parts)
    assert torch.equal(whole.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for a, b in zip(whole.split([3, 5, 2]), parts):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_repack_rejects_a_shape_that_does_not_fit_the_bytes():
    raw, _ = _q8(4, 64, 0)
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        repack_q8_0(raw, (8, 33))
    with pytest.raises(ValueError, match="takes 340 bytes"):
        repack_q8_0(raw, (5, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_reference_is_linear_on_the_dequantized_matrix(dtype, M):
    _, m = _q8(19, 256, M)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(dtype)
    got = q8_linear(x, m.codes, m.scales)
    assert got.dtype == dtype and got.shape == (M, 19)
    assert torch.equal(got, linear(x.float(), m.dequantize()).to(dtype))


def test_op_rejects_mismatched_operands():
    _, m = _q8(4, 64, 1)
    with pytest.raises(ValueError, match="do not make one"):
        q8_linear(torch.randn(2, 32), m.codes, m.scales)
    with pytest.raises(ValueError, match="int8 and scales float16"):
        q8_linear(torch.randn(2, 64), m.codes, m.scales.float())


def test_opcheck_on_cpu():
    _, m = _q8(6, 128, 2)
    torch.library.opcheck(torch.ops.strata.q8_linear.default, (torch.randn(3, 128), m.codes, m.scales))


@pytest.mark.parametrize("M, N, K", [(1, 5120, 2048), (4, 2048, 4096), (16, 128, 2048), (1, 151936, 2048),
                                     (3, 7, 96), (0, 4, 64)])
def test_launch_bounds_a_step(M, N, K):
    """A step reads at most ``tile`` codes, a program takes at most ``max_bn`` rows of W and ``max_mb``
    of x, and a row's read per step covers the whole row or at least ``tile / max_bn`` codes."""
    config = Q8Config()
    mb, bn, nb = config.launch(M, N, K)
    assert bn * nb * 32 <= config.tile and bn <= config.max_bn and mb <= config.max_mb
    assert nb * 32 >= min(K, config.tile // config.max_bn)


def _kernel_case(device: str, dtype: torch.dtype, M: int, N: int, K: int, config: Q8Config | None):
    _, m = _q8(N, K, N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    want = q8_linear(x, m.codes, m.scales)  # the CPU reference
    dev = m.to(device)
    got = dense_q8.q8_linear_triton(x.to(device), dev.codes, dev.scales, config or dense_q8.DEFAULT_LAUNCH)
    assert got.dtype == dtype and got.shape == (M, N)
    assert _rel(got, want) <= TOL[dtype], (M, N, K, dtype, config)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N, K", [(37, 96), (129, 1024)])
def test_kernel_matches_the_reference(device, dtype, M, N, K):
    """N not a multiple of the rows a program takes, K not a multiple of a step (96: 3 blocks), M
    beyond one tile of x rows (8 > max_mb), with the default launch and with small tiles."""
    for config in (None, Q8Config(tile=256, bn=2, max_mb=2), Q8Config(tile=128, bn=4)):
        _kernel_case(device, dtype, M, N, K, config)


@needs_cuda
@pytest.mark.parametrize("M, N, K", [(1, 5120, 2048), (4, 2048, 4096), (1, 128, 2048), (16, 151936, 256)])
def test_kernel_matches_the_reference_at_decode_shapes(M, N, K):
    _kernel_case("cuda", torch.bfloat16, M, N, K, None)


@needs_cuda
def test_opcheck_on_cuda():
    _, m = _q8(300, 512, 3)
    dev = m.to("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.strata.q8_linear.default,
                              (torch.randn(3, 512).to(dtype).cuda(), dev.codes, dev.scales))


# --- the rows kernel (several rows of x, each W tile read once for all of them) -------------------

ROWS_M = [1, 2, 3, 8, 17, 32]
#: the interpreter's bf16 ``tl.dot`` is wrong, its int8 one right: there the bf16 / deq modes run float32 x
ROWS_CASES = [("bf16", torch.bfloat16), ("deq", torch.bfloat16), ("i8", torch.bfloat16), ("bf16", torch.float32),
              ("deq", torch.float32)]
#: quantizing x to int8 per 32 values costs the accuracy of tests/test_moe_q8.py's bf16 tolerance
ROWS_TOL = {"i8": 2e-2}


@pytest.mark.parametrize("N, K", [(1, 32), (37, 96), (129, 1024), (5120, 2048), (151936, 2048)])
@pytest.mark.parametrize("config", [Q8RowsConfig(), Q8RowsConfig(bn=16, nb=8, programs=4096), Q8RowsConfig(programs=0)])
def test_rows_launch_covers_k_in_whole_steps(N, K, config):
    """K is cut into ranges of whole steps (the last maybe shorter) that cover it, each non-empty; the
    launch depends on the matrix alone (not on M: a row's order of sums is the same in any window)."""
    splits, blocks = config.launch(N, K)
    kb = K // 32
    assert blocks % config.nb == 0 and splits >= 1
    assert (splits - 1) * blocks < kb <= splits * blocks
    if not config.programs:
        assert splits == 1


def test_rows_config_rejects_bad_launches():
    with pytest.raises(ValueError, match="mode"):
        Q8RowsConfig(mode="fp8")
    with pytest.raises(ValueError, match="at least 16"):
        Q8RowsConfig(bn=8)
    with pytest.raises(ValueError, match="power of two"):
        Q8RowsConfig(nb=3)


def _rows_case(device: str, mode: str, dtype: torch.dtype, N: int, K: int, config: Q8RowsConfig):
    """Every M of :data:`ROWS_M`: within tolerance of the reference, and each row the bits of that row
    alone (a 1-row call), whatever M."""
    config = dataclasses.replace(config, mode=mode)
    _, m = _q8(N, K, N + K)
    dev = m.to(device)
    x = torch.randn(max(ROWS_M), K, generator=torch.Generator().manual_seed(K)).to(dtype)
    alone = [dense_q8.q8_rows_triton(x[r:r + 1].to(device), dev.codes, dev.scales, config)[0] for r in range(len(x))]
    for M in ROWS_M:
        got = dense_q8.q8_rows_triton(x[:M].to(device), dev.codes, dev.scales, config)
        assert got.dtype == dtype and got.shape == (M, N)
        want = q8_linear(x[:M], m.codes, m.scales)  # the CPU reference
        tol = ROWS_TOL.get(mode, TOL[dtype])
        assert _rel(got, want) <= tol, (M, N, K, mode, dtype, config)
        for r in range(M):
            assert torch.equal(got[r], alone[r]), (M, r, mode, dtype, config)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode, dtype", ROWS_CASES)
@pytest.mark.parametrize("N, K", [(37, 96), (129, 1024)])
def test_rows_kernel_matches_the_reference_and_keeps_rows_apart(device, mode, dtype, N, K):
    """N not a multiple of a program's W rows, K not a multiple of a step (96: 3 blocks) or of a split,
    M from 1 to two x tiles (17, 32 > bm = 16), K split into ranges or not."""
    if device == "cpu" and mode != "i8" and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 tl.dot is wrong")
    for config in (Q8RowsConfig(bn=16, nb=2, programs=64), Q8RowsConfig(nb=8, programs=0)):
        _rows_case(device, mode, dtype, N, K, config)


@pytest.mark.skipif(not dense_q8.HAS_TRITON, reason="needs Triton")
def test_rows_kernel_refuses_float32_x_for_int8():
    _, m = _q8(16, 64, 0)
    with pytest.raises(ValueError, match="float32"):
        dense_q8.q8_rows_triton(torch.randn(2, 64), m.codes, m.scales, Q8RowsConfig(mode="i8"))


@needs_cuda
@pytest.mark.parametrize("N, K", [(5120, 2048), (2048, 4096), (128, 2048), (151936, 256)])
def test_rows_kernel_at_decode_shapes(N, K):
    """The default launch at the decode shapes, bf16 x, every M."""
    _rows_case("cuda", dense_q8.DEFAULT_ROWS.mode, torch.bfloat16, N, K, dense_q8.DEFAULT_ROWS)


@needs_cuda
@pytest.mark.parametrize("M", ROWS_M)
def test_op_on_cuda_takes_each_row_count(M):
    """``strata::q8_linear`` on CUDA (the gemv for few rows, the rows kernel beyond) within tolerance at
    every window size, and opcheck'ed (fake, autograd registration, schema)."""
    _, m = _q8(300, 512, 3)
    dev = m.to("cuda")
    x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    got = q8_linear(x.cuda(), dev.codes, dev.scales)
    assert _rel(got, q8_linear(x, m.codes, m.scales)) <= ROWS_TOL.get(dense_q8.DEFAULT_ROWS.mode, 1e-2)
    torch.library.opcheck(torch.ops.strata.q8_linear.default, (x.cuda(), dev.codes, dev.scales))


# --- the fused decode path reading the copies (model/fused_decode.py) ------------------------------

def _q8_engine(path, monkeypatch, on: bool) -> Engine:
    """An engine on the CPU that, with ``on``, places the Q8_0 copies as it would on a CUDA device taking
    the fused path (``why_not_fused`` answers None for the CPU while it loads)."""
    monkeypatch.setattr(fused_decode, "why_not_fused", lambda model, device: None)
    engine = Engine.load(path, devices=["cpu"], max_context=64, dtype="float32", dense_q8=on)
    monkeypatch.undo()
    return engine


def _counting(monkeypatch) -> list:
    calls: list = []
    real = weights_module.q8_linear

    def count(x, codes, scales):
        calls.append(tuple(codes.shape))
        return real(x, codes, scales)
    monkeypatch.setattr(weights_module, "q8_linear", count)
    return calls


def test_load_places_and_counts_the_q8_copies(tiny_model_factory, monkeypatch, caplog):
    """Every Q8_0 decode product of every layer and the head get a copy, logged with their bytes, and
    the bytes join the dense part the expert cache is sized after; with ``--no-dense-q8``: none."""
    path = tiny_model_factory(expert_type="Q4_0", dense_type="Q8_0", n_layers=3)
    caplog.set_level(logging.INFO, logger=fused_decode.__name__)
    engine = _q8_engine(path, monkeypatch, True)
    w, spec = engine.model.weights, engine.spec
    names = [n for n in fused_decode.Q8_LAYER_NAMES
             if engine.gguf_file.tensor(f"blk.0.{n}").qtype == T.Q8_0]
    assert {"attn_q.weight", "attn_output.weight"} <= set(names)
    for layer in range(spec.n_layers):
        mats = w.q8_at(layer, "cpu")
        assert sorted(mats) == sorted(names)
        for name, m in mats.items():
            assert torch.equal(m.dequantize(), w.at(layer, "cpu")[name])
    assert torch.equal(w.q8_at(None, "cpu")["output.weight"].dequantize(), w.globals["output.weight"])
    expected = sum(m.nbytes for layer in [None, *range(spec.n_layers)] for m in w.q8_at(layer, "cpu").values())
    assert f"Q8_0 copies of the dense decode products (strata::q8_linear): {expected / 2**30:.2f} GiB " \
           f"({expected} bytes)" in caplog.text
    assert _q8_engine(path, monkeypatch, False).model.weights.q8_at(0, "cpu") == {}


@pytest.mark.parametrize("n_sessions", [1, 2])
def test_fused_decode_reads_the_q8_copies(tiny_model_factory, monkeypatch, n_sessions):
    """One session's fused layers and head read the Q8_0 copies (q8_linear: the QKV, output and router
    products of each layer, then the head); a window of two reads the float copies of matrices smaller
    than ``Q8_ROWS_MIN_VALUES`` (all of the tiny model's). On the CPU, where the op is the float32
    reference, the logits are the float copies' bit for bit."""
    path = tiny_model_factory(expert_type="Q4_0", dense_type="Q8_0", n_layers=3)
    prompts = [list(range(5, 30)), list(range(40, 52))][:n_sessions]
    tokens = torch.tensor([3, 9][:n_sessions])
    outs = []
    for on in (False, True):
        engine = _q8_engine(path, monkeypatch, on)
        sessions = [engine.new_session() for _ in prompts]
        for session, prompt in zip(sessions, prompts):
            engine.prefill(session, prompt)
        (segment,) = engine.runner.segments("decode")
        hidden = engine.runner.embed(tokens, torch.device("cpu"))
        calls = _counting(monkeypatch)
        h = engine.runner.decode_layers(segment, hidden, DecodeBatch(tuple(sessions), tokens), fused=True)
        outs.append(engine.model.head(h))
        monkeypatch.undo()
        if on and n_sessions == 1:
            per_layer = len(engine.model.weights.q8_at(0, "cpu"))  # q, k and v are one product
            assert len(calls) == engine.spec.n_layers * (per_layer - 2) + 1
            assert calls[-1] == (engine.spec.vocab_size, engine.spec.hidden_size)
        else:
            assert calls == []
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("rows", [1, 2, weights_module.Q8_MAX_ROWS, weights_module.Q8_MAX_ROWS + 1])
@pytest.mark.parametrize("big", [False, True])
def test_dense_product_reads_the_copy_up_to_q8_max_rows(monkeypatch, rows, big):
    """``dense_product`` takes the Q8_0 copy for one row of x (any leading shape), and for 2 to
    ``Q8_MAX_ROWS`` rows where the matrix has ``Q8_ROWS_MIN_VALUES`` values (``big``: the threshold
    lowered to this one's), the float copy otherwise."""
    _, m = _q8(24, 64, 5)
    weight = m.dequantize()
    x = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(rows))
    if big:
        monkeypatch.setattr(weights_module, "Q8_ROWS_MIN_VALUES", 24 * 64)
    calls = _counting(monkeypatch)
    got = weights_module.dense_product(x, weight, m)
    assert got.shape == (rows, 1, 24)
    assert calls == ([(24, 64)] if rows == 1 or (big and rows <= weights_module.Q8_MAX_ROWS) else [])
    assert torch.equal(got, linear(x, weight))
    assert torch.equal(weights_module.dense_product(x[:0], weight, m), linear(x[:0], weight))


@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_decode_through_the_q8_copies(tiny_model_factory, monkeypatch, graphs):
    """On CUDA the engine places the copies by itself (``--dense-q8``) and its greedy decode, eager or
    replayed as graphs, gives the float32 engine's tokens with logits within 1e-4 (same values,
    another summation order)."""
    path = tiny_model_factory(expert_type="Q4_0", dense_type="Q8_0", n_layers=3)
    prompts = [list(range(5, 60)), list(range(70, 90))]
    runs = []
    for on in (False, True):
        engine = Engine.load(path, devices=["cuda:0"], max_context=128, dtype="float32", arena="pinned",
                             expert_cache=7, cuda_graphs=graphs, dense_q8=on)
        assert bool(engine.model.weights.q8_at(0, "cuda:0")) == on
        assert bool(engine.model.weights.q8_at(None, "cuda:0")) == on
        runs.append(_decode(engine, prompts, 8))
    (want, want_tokens), (got, got_tokens) = runs
    assert got_tokens == want_tokens
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
    assert diff <= 1e-4, diff
