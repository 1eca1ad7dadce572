"""Quantized KV (``--kv-type``, model/kvquant.py): the round trip's bounds and GGML's Q8_0 layout; every
attention kind over quantized rows against the float attention over the same (dequantized) rows; the
tiny models' logits within the documented tolerance of the unquantized KV; the bytes a token; paged
blocks, shared prefixes, hand-offs and snapshots moving codes and scales exactly; the errors."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from strata_core.cli.info import describe
from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.model.fused_decode import why_not_fused
from strata_core.model.kvcache import KVCache
from strata_core.model.kvpool import KVPools
from strata_core.model.kvquant import (FP8, LOGIT_TOLERANCE, QuantizedRows, dequantize, kv_format, quantize,
                                       stored_layout, token_bytes)
from strata_core.model import ops
from strata_core.model.ops import dequantized_sdpa, masked_attention
from strata_core.model.rope import scaled_inv_freq
from strata_core.model.spec import StateTensor
from strata_core.ops.mla import mla_blocked, mla_reference
from strata_core.ops.qdecode import HAS_TRITON
from strata_core.plugin.placement import DeviceSlot, LayerPlacement, Placement
from strata_core.runtime.memory_plan import dense_bytes_per_device
from test_batch_invariance import DEEPSEEK2, GPT_OSS, QWEN3NEXT
from test_paged_kv import _run, held, repool

QUANTIZED = ["q8_0", "int8"] + (["fp8"] if FP8 is not None else [])
ARCHS = ["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"]


def _path(arch: str, factory):
    return {"gpt-oss": GPT_OSS, "qwen3next": QWEN3NEXT, "deepseek2": DEEPSEEK2}.get(arch) or factory(expert_type="Q8_0")


# --- the round trip --------------------------------------------------------------------------------------

@given(rows=st.integers(1, 6), width=st.sampled_from([4, 16, 32, 64, 96]), kv_type=st.sampled_from(QUANTIZED),
       magnitude=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=60, deadline=None)
def test_a_round_trip_stays_within_half_a_step_of_its_group(rows, width, kv_type, magnitude, seed):
    fmt = kv_format(kv_type)
    x = torch.randn(rows, 3, width, generator=torch.Generator().manual_seed(seed)) * magnitude
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0, back to zeros
    codes, scales = quantize(x, fmt)
    assert codes.dtype == fmt.storage and scales.dtype == fmt.scale and codes.shape == x.shape
    groups = scales.shape[-1]
    assert groups == (width // 32 if kv_type == "q8_0" and width > 32 else 1)
    back = dequantize(codes, scales)
    step = (x.reshape(rows, 3, groups, -1).abs().amax(-1) / fmt.qmax)[..., None]  # [rows, 3, G, 1]
    err = (back - x).abs().reshape(rows, 3, groups, -1)
    if fmt.codes == torch.int8:
        # half a step, plus 127 times the float16 rounding of q8_0's scale (2^-11 of it, 2^-25 below float16's
        # normal range)
        rounding = torch.maximum(step * 2 ** -11, torch.tensor(2 ** -25)) if kv_type == "q8_0" else step * 1e-6
        assert (err <= step * 0.5 + 127 * rounding + 1e-12).all()
        assert codes.abs().max() <= 127
    else:
        assert (err <= x.abs().reshape(err.shape) / 16 + step * 2 ** -9 + 1e-12).all()
    assert torch.equal(back[0, 0], torch.zeros(width))


def test_q8_0_codes_and_scales_are_ggml_s():
    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(3)) * 3
    x[1, 2, :32] = torch.arange(32) - 15.5  # ties: halves round away from zero, as GGML's roundf
    codes, scales = quantize(x, kv_format("q8_0"))
    blocks = gguf_quantize(x.reshape(-1, 64).numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)  # d f16 | 32 x i8
    assert np.array_equal(blocks[:, :2].copy().view(np.float16).ravel(), scales.reshape(-1).numpy())
    assert np.array_equal(blocks[:, 2:].copy().view(np.int8), codes.reshape(-1, 32).numpy())


def test_quantized_rows_slice_the_leading_dims_and_dequantize_a_range():
    codes, scales = quantize(torch.randn(10, 2, 64), kv_format("q8_0"))
    rows = QuantizedRows(codes, scales)
    assert rows.shape == (10, 2, 64) and rows[:, 1:].shape == (10, 1, 64)
    assert torch.equal(rows.rows(3, 7, torch.float32), dequantize(codes, scales)[3:7])
    with pytest.raises(IndexError):
        rows[..., :3]


# --- attention against the float reference ---------------------------------------------------------------

def _naive(q, keys, values, positions, window=None, sinks=None):
    """float64 causal GQA attention ``[T, nh*D]`` of ``q [T, nh, D]`` over ``keys``/``values [S, nkv, D]``."""
    T, nh, D = q.shape
    S, nkv = keys.shape[:2]
    k = keys.double().repeat_interleave(nh // nkv, dim=1)  # [S, nh, D]
    v = values.double().repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * D ** -0.5  # [nh, T, S]
    offset = positions[:, None] - torch.arange(S)[None, :]
    visible = (offset >= 0) & (offset < window) if window else offset >= 0
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[:, None, None].expand(nh, T, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :S]
    return torch.einsum("hts,shd->thd", probs, v).reshape(T, nh * D)


@given(kv_type=st.sampled_from(QUANTIZED), S=st.integers(1, 600), T=st.integers(1, 5), nkv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 3]), D=st.sampled_from([16, 64]), window=st.sampled_from([None, 4, 300]),
       sinks=st.booleans(), seed=st.integers(0, 2 ** 16))
@settings(max_examples=40, deadline=None)
def test_masked_attention_over_quantized_rows_is_the_attention_over_their_values(kv_type, S, T, nkv, rep, D, window,
                                                                                  sinks, seed):
    """GQA, sliding windows and sinks: key blocks of 256 dequantized one at a time, against a float64
    reference over the dequantized rows (and near the unquantized rows' attention)."""
    g = torch.Generator().manual_seed(seed)
    fmt = kv_format(kv_type)
    keys, values = torch.randn(S, nkv, D, generator=g), torch.randn(S, nkv, D, generator=g)
    q = torch.randn(T, nkv * rep, D, generator=g)
    positions = torch.randint(0, S, (T,), generator=g)
    sink = torch.randn(nkv * rep, generator=g) if sinks else None
    kq, vq = QuantizedRows(*quantize(keys, fmt)), QuantizedRows(*quantize(values, fmt))
    got = masked_attention(q, kq, vq, positions, window, sink)
    want = _naive(q, kq.rows(0, S, torch.float32), vq.rows(0, S, torch.float32), positions, window, sink)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
    loose = 0.05 if kv_type != "fp8" else 0.25
    assert torch.allclose(got.double(), _naive(q, keys, values, positions, window, sink), atol=loose)


@given(kv_type=st.sampled_from(QUANTIZED), S=st.integers(2, 700), T=st.integers(2, 40), nkv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 4]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None)
def test_a_prompt_chunk_s_fused_attention_over_dequantized_rows_is_the_blocked_one(kv_type, S, T, nkv, rep, seed):
    """``dequantized_sdpa`` (a prompt chunk off the CPU: the layer's rows dequantized for one fused
    attention) against the blocked online softmax over the same quantized rows; a chunk is the last T of S."""
    g = torch.Generator().manual_seed(seed)
    fmt, D, T = kv_format(kv_type), 32, min(T, S)
    kq = QuantizedRows(*quantize(torch.randn(S, nkv, D, generator=g), fmt))
    vq = QuantizedRows(*quantize(torch.randn(S, nkv, D, generator=g), fmt))
    q = torch.randn(T, nkv * rep, D, generator=g)
    positions = torch.arange(S - T, S)
    got = dequantized_sdpa(q, kq, vq, positions)
    want = ops._quantized_attention(q, kq, vq, positions, None, None)  # the blocked form any device takes
    assert got.shape == (T, nkv * rep * D) and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_prompt_chunk_past_the_dequantize_bound_takes_the_blocked_form(monkeypatch):
    fmt = kv_format("int8")
    kq = QuantizedRows(*quantize(torch.randn(64, 2, 16), fmt))
    q, positions = torch.randn(8, 4, 16), torch.arange(56, 64)
    monkeypatch.setattr(ops, "PROMPT_DEQUANT_BYTES", 2 * 64 * 2 * 16 * 4)  # exactly the float32 rows: fits
    assert dequantized_sdpa(q, kq, kq, positions) is not None
    monkeypatch.setattr(ops, "PROMPT_DEQUANT_BYTES", 2 * 64 * 2 * 16 * 4 - 1)
    assert dequantized_sdpa(q, kq, kq, positions) is None


@given(kv_type=st.sampled_from(QUANTIZED), S=st.integers(1, 600), T=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
@settings(max_examples=20, deadline=None)
def test_mla_over_quantized_latent_and_rope_is_the_reference_over_their_values(kv_type, S, T, seed):
    g = torch.Generator().manual_seed(seed)
    fmt = kv_format(kv_type)
    nh, C, r = 3, 64, 16
    latent, rope = torch.randn(S, C, generator=g), torch.randn(S, r, generator=g)
    q_lat, q_rope = torch.randn(nh, T, C, generator=g), torch.randn(nh, T, r, generator=g)
    positions = torch.randint(0, S, (T,), generator=g)
    lq, rq = QuantizedRows(*quantize(latent, fmt)), QuantizedRows(*quantize(rope, fmt))
    got = mla_blocked(q_lat, q_rope, lq, rq, positions, 0.1)
    want = mla_reference(q_lat.double(), q_rope.double(), lq.rows(0, S, torch.float64), rq.rows(0, S, torch.float64),
                         positions, 0.1)
    assert got.shape == (nh, T, C) and torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


class RoundTrip(KVCache):
    """A float cache holding exactly the values a quantized cache stores: each row quantized and
    dequantized on its way in (its attention is the stock float path)."""

    fmt = None

    def write(self, layer, positions, **rows):
        super().write(layer, positions, **{n: dequantize(*quantize(v, self.fmt)) for n, v in rows.items()})


@pytest.fixture(scope="module", params=ARCHS)
def arch_engine(request, tiny_model_factory):
    return Engine.load(_path(request.param, tiny_model_factory), max_context=640)


@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_every_attention_kind_over_quantized_kv_is_the_float_attention_over_its_values(arch_engine, kv_type):
    """The model's own attention layers (GQA with QK-norm, gpt-oss's windows and sinks, qwen3next's gated
    attention, deepseek2's MLA latent and rope key) over a quantized cache, against the stock float
    path over a cache holding the dequantized values; two chunks crossing a 256-key block."""
    model, spec = arch_engine.model, arch_engine.spec
    g = torch.Generator().manual_seed(1)
    RoundTrip.fmt = kv_format(kv_type)
    caches = [KVCache.for_spec(spec, 640, kv_type=kv_type), RoundTrip.for_spec(spec, 640)]
    attention_layers = [i for i in range(spec.n_layers) if any(t.per_token for t in spec.layer_state(i).values())]
    for start, n in ((0, 300), (300, 7)):
        h = torch.randn(n, spec.hidden_size, generator=g)
        positions = torch.arange(start, start + n)
        outs = []
        for kv in caches:
            kv.reserve(start + n)
            outs.append([model.attention(i, h, positions, kv) for i in attention_layers])
            kv.advance(n)
        for layer, got, want in zip(attention_layers, *outs):
            if spec.architecture == "deepseek2":  # a blocked softmax against the reference's one over all keys
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (layer, (got - want).abs().max())
            else:  # the same key blocks, dequantized when read or before: the same bits
                assert torch.equal(got, want), (spec.architecture, layer, (got - want).abs().max())
    assert all(isinstance(t, QuantizedRows) for t in caches[0].read(attention_layers[0], 8,
                                                                   *spec.layer_state(attention_layers[0])))


# --- end to end ------------------------------------------------------------------------------------------

PROMPT = list(range(3, 100))


def _deviation(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position: the largest logit difference over the largest logit's magnitude."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


@pytest.fixture(scope="module", params=ARCHS)
def logits_by_type(request, tiny_model_factory):
    path = _path(request.param, tiny_model_factory)
    out = {}
    for kv_type in ["auto", "bf16", *QUANTIZED]:
        engine = Engine.load(path, max_context=256, kv_type=kv_type)
        session = engine.new_session()
        out[kv_type] = torch.cat([engine.prefill(session, PROMPT[:60], all_logits=True),
                                  engine.prefill(session, PROMPT[60:], all_logits=True),
                                  engine.decode_window([(session, 5)]), engine.decode_window([(session, 9)])])
    return out


@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_logits_with_quantized_kv_are_within_the_documented_tolerance(logits_by_type, kv_type):
    """LOGIT_TOLERANCE bounds the median and the 90th percentile over positions of the largest logit
    difference (over the largest logit), q8_0 and int8 against the unquantized KV; fp8 (3 mantissa
    bits) the median at FP8_TOLERANCE. The largest position is not bounded: a routed expert chosen
    otherwise (a near tie of the router) moves a token's logits as far with bf16 rows."""
    deviation = _deviation(logits_by_type[kv_type], logits_by_type["auto"])
    median, p90 = deviation.median().item(), deviation.quantile(0.9).item()
    if kv_type == "fp8":
        assert median <= LOGIT_TOLERANCE["fp8"], median
    else:
        assert median <= LOGIT_TOLERANCE["median"] and p90 <= LOGIT_TOLERANCE["p90"], (median, p90)
    bf16 = _deviation(logits_by_type["bf16"], logits_by_type["auto"]).median().item()
    assert median > 0 and bf16 > 0  # the rows really were stored otherwise


def test_the_default_kv_is_stock(tiny_model_factory):
    """``auto``: the pools hold K and V in the compute dtype and nothing else; the logits are those of
    a cache made without any kv type."""
    path = tiny_model_factory(expert_type="Q8_0")
    engine = Engine.load(path, max_context=64)
    assert engine.settings.kv_type == "auto"
    pool = engine.kv_pools.pools[0]
    assert all(set(named) == {"k", "v"} and all(t.dtype == torch.float32 for t in named.values())
               for named in pool.rows.values())
    assert engine.model.kernels.kv_type == "auto" and engine.new_session().kv.kv_format is None
    assert why_not_fused(engine.model, torch.device("cuda", 0)) is None or "--kv-type" not in why_not_fused(
        engine.model, torch.device("cuda", 0))
    cuda = torch.device("cuda", 0)
    for kv_type in ("q8_0", "int8"):  # the fused kernels read these as they read the default's rows
        assert why_not_fused(Engine.load(path, max_context=64, kv_type=kv_type).model, cuda) == why_not_fused(
            engine.model, cuda)
    if FP8 is not None:  # fp8 rows: read by the fused kernels where the GPU converts e4m3, else the eager layers
        reason = why_not_fused(Engine.load(path, max_context=64, kv_type="fp8").model, cuda)
        if torch.cuda.is_available() and torch.cuda.get_device_capability(cuda) >= (8, 9):
            assert reason == why_not_fused(engine.model, cuda)
        else:
            assert reason is not None and (not HAS_TRITON or "--kv-type" in reason)


def test_bf16_rows_under_bf16_compute_keep_the_fused_decode(tiny_model_factory):
    path = tiny_model_factory(expert_type="Q8_0")
    same = Engine.load(path, max_context=64, kv_type="bf16", dtype="bfloat16")
    cast = Engine.load(path, max_context=64, kv_type="bf16")  # float32 compute on the CPU
    assert same.model.kernels.kv_type == "auto" and cast.model.kernels.kv_type == "bf16"
    for engine in (same, cast):
        assert all(t.dtype == torch.bfloat16 for named in engine.kv_pools.pools[0].rows.values() for t in named.values())


# --- bytes ---------------------------------------------------------------------------------------------------

def test_kv_bytes_a_token_are_about_halved():
    """int8 and q8_0 rows of a 128-wide head take at most 54% of bf16's bytes (codes, plus a float32 scale
    per head for int8 and a float16 scale per 32 values for q8_0)."""
    layout = {"k": StateTensor((8, 128)), "v": StateTensor((8, 128))}
    bf16 = token_bytes(layout, "bf16")
    assert bf16 == 2 * 8 * 128 * 2
    assert token_bytes(layout, "q8_0") == 2 * 8 * (128 + 4 * 2)
    assert token_bytes(layout, "int8") == 2 * 8 * (128 + 4)
    for kv_type in QUANTIZED:
        assert token_bytes(layout, kv_type) <= 0.54 * bf16
    mla = {"latent": StateTensor((512,)), "rope": StateTensor((64,))}
    assert token_bytes(mla, "q8_0") == 512 + 16 * 2 + 64 + 2 * 2 <= 0.54 * token_bytes(mla, "bf16")
    recurrent = {"ssm": StateTensor((4, 8, 8), per_token=False, dtype=torch.float32)}
    assert stored_layout(recurrent, "int8") == recurrent and token_bytes(recurrent, "int8") == 0


@pytest.mark.parametrize("kv_type", ["bf16", *QUANTIZED])
def test_pools_and_the_memory_plan_count_the_stored_bytes(tiny_model_factory, kv_type):
    engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=64, kv_type=kv_type)
    spec, pools = engine.spec, engine.kv_pools
    per_token = sum(token_bytes(spec.layer_state(i), kv_type) for i in range(spec.n_layers))
    assert pools.pools[0].nbytes == pools.n_blocks * pools.block_size * per_token
    one = tuple(LayerPlacement.local(0) for _ in range(spec.n_layers))
    plan = {t: dense_bytes_per_device(spec, Placement(one, one), {0: DeviceSlot(0, torch.device("cpu"))},
                                      torch.bfloat16, 1000, t)[torch.device("cpu")] for t in ("bf16", kv_type)}
    auto_bytes = sum(token_bytes(spec.layer_state(i), "bf16") for i in range(spec.n_layers))
    assert plan["bf16"] - plan[kv_type] == 1000 * (auto_bytes - per_token)
    if kv_type != "bf16":
        assert per_token < 0.6 * auto_bytes


def test_a_context_that_cannot_fit_is_an_error_before_loading(tiny_model_factory, monkeypatch):
    """A budget that holds the weights and half the float KV of the model's whole context: the load fails
    before any weight is read, saying how much of the need is the KV cache of how many tokens and what
    takes less; the same context with --kv-type int8 (about a quarter of float32's bytes) loads."""
    from strata_core.model.weights import DenseWeights
    from strata_core.errors import BudgetError
    from strata_core.experts.sizing import GIB
    from strata_core.runtime.memory_plan import kv_bytes_per_device

    path = tiny_model_factory(expert_type="Q8_0")
    spec = Engine.load(path, max_context=64).spec
    context, cpu = spec.context_length, torch.device("cpu")
    one = tuple(LayerPlacement.local(0) for _ in range(spec.n_layers))
    plan = [f(spec, Placement(one, one), {0: DeviceSlot(0, cpu)}, torch.float32, 2 * context + 32)[cpu]
            for f in (dense_bytes_per_device, kv_bytes_per_device)]  # two sessions, the null and padding blocks
    options = dict(max_context=context, parallel=2, reserve_mib=0, expert_cache=0,
                   vram_budget_gib=(plan[0] - plan[1] / 2) / GIB)
    load = DenseWeights.load
    monkeypatch.setattr(DenseWeights, "load", lambda *a, **k: pytest.fail("weights read before the budget check"))
    with pytest.raises(BudgetError, match=rf"{plan[1] / GIB:.2f} GiB of it is the KV cache of {2 * context} tokens "
                                          r"\(--kv-pool-tokens.*--kv-type auto\).*--max-context.*--parallel.*int8"):
        Engine.load(path, **options)
    monkeypatch.setattr(DenseWeights, "load", load)
    engine = Engine.load(path, kv_type="int8", **options)
    assert engine.max_context == context and engine.kv_pools.kv_type == "int8"


def test_strata_info_shows_the_bytes_a_token_per_kv_type(tiny_model_factory):
    path = tiny_model_factory(expert_type="Q8_0")
    report = describe(path, [8.0])
    spec = Engine.load(path, max_context=64).spec
    line = next(line for line in report.splitlines() if line.startswith("KV per token by --kv-type"))
    for kv_type in QUANTIZED:
        total = sum(token_bytes(spec.layer_state(i), kv_type) for i in range(spec.n_layers))
        assert f"{kv_type} {total}" in line


def _gpu_gib(report: str) -> float:
    line = next(line for line in report.splitlines() if line.startswith("on a GPU the dense part"))
    return float(line.split(": ")[1].split(" GiB")[0])


def test_strata_info_sizes_the_kv_cache_by_kv_type(tmp_path):
    """``strata info --kv-type T --max-context N``: the GPU line counts N tokens of T's bytes (a 4M-token
    context, so the difference shows in the line's GiB)."""
    from gguf import GGMLQuantizationType as Q

    from strata_core.gguf.reader import GGUFFile
    from strata_core.model.registry import load_model_spec
    from strata_core.tools.synthetic import write_synthetic

    path, n = tmp_path / "long.gguf", 1 << 22
    write_synthetic(path, "tiny", expert_type=Q.Q8_0, n_layers=1, context=n, progress=False)
    spec = load_model_spec(GGUFFile.open(path))
    gib = {t: _gpu_gib(describe(path, [8.0], n, t)) for t in ("auto", "int8")}
    saved = n * sum(token_bytes(spec.layer_state(i), "bf16") - token_bytes(spec.layer_state(i), "int8")
                    for i in range(spec.n_layers))
    assert saved > 2 ** 29 and gib["auto"] - gib["int8"] == pytest.approx(saved / 2 ** 30, abs=0.011)
    assert "(--kv-type int8)" in describe(path, [8.0], n, "int8")


# --- paging, sharing, hand-off, snapshots --------------------------------------------------------------------

@pytest.fixture(scope="module", params=[("qwen3moe", "q8_0"), ("gpt-oss", "int8"), ("qwen3next", "q8_0"),
                                        ("deepseek2", "int8")], ids=lambda p: "-".join(p))
def quantized_engines(request, tiny_model_factory):
    arch, kv_type = request.param
    path = _path(arch, tiny_model_factory)
    return (Engine.load(path, max_context=64, parallel=3, kv_type=kv_type),
            Engine.load(path, max_context=64, parallel=3, kv_block=64, kv_type=kv_type))


@given(block=st.integers(1, 24), first=st.integers(2, 30), pieces=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       common=st.integers(0, 30), tail=st.integers(1, 8), cut=st.integers(1, 30))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_quantized_paged_logits_are_bit_identical_to_a_block_per_session(quantized_engines, block, first, pieces,
                                                                         common, tail, cut):
    """Blocks, shared prefixes (codes and scales shared), copy-on-write and chunking change no bit."""
    paged, whole = quantized_engines
    repool(paged, block)
    one = list(range(10, 10 + first))
    common = min(common, first)
    two = one[:common] + list(range(50, 50 + tail))
    got, shared = _run(paged, one, pieces + [first], two, cut)
    want, _ = _run(whole, one, pieces + [first], two, cut)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert shared == ((min(common, len(two) - 1) // block) * block if paged.spec.rewindable else 0)
    assert held(paged) == 0


def test_quantized_logits_do_not_depend_on_the_chunks_or_the_batch(quantized_engines):
    """On the CPU a row's logits are bit-identical however its prompt is chunked and whatever else its
    decode window holds (each row quantized alone, key blocks of a fixed size)."""
    engine = quantized_engines[0]
    whole, pieces, other = engine.new_session(), engine.new_session(), engine.new_session()
    want = engine.prefill(whole, PROMPT[:30], all_logits=True)
    got = torch.cat([engine.prefill(pieces, PROMPT[i:j], all_logits=True) for i, j in ((0, 7), (7, 8), (8, 30))])
    assert torch.equal(got, want)
    engine.prefill(other, PROMPT[40:52])
    alone = engine.decode_window([(whole, 5)])
    together = engine.decode_window([(other, 9), (pieces, 5)])
    assert torch.equal(together[1:], alone)
    for session in (whole, pieces, other):
        engine.release_session(session)


@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_a_snapshot_restores_codes_and_scales_exactly(tiny_model_factory, kv_type):
    """The conversation cache's round trip: the snapshot holds the codes and scales as stored, a
    restored session holds them again, bit for bit, and decodes as the original."""
    engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=64, kv_block=4, kv_type=kv_type)
    a = engine.new_session()
    engine.prefill(a, list(range(40, 53)))
    snap = engine.save_session(a)
    stored = {i: a.kv.committed(i) for i in a.kv.layers}
    assert all(set(named) == {"k", "k_scale", "v", "v_scale"} for named in stored.values())
    assert stored[0]["k"].dtype == kv_format(kv_type).storage
    want = engine.decode_window([(a, 4)])
    engine.release_session(a)
    b = engine.restore_session(snap)
    for i in b.kv.layers:
        for name, tensor in b.kv.committed(i).items():
            assert torch.equal(tensor.view(torch.uint8), stored[i][name].view(torch.uint8)), (i, name)
    assert torch.equal(engine.decode_window([(b, 4)]), want)
    assert snap.nbytes == sum(t.numel() * t.element_size() for named in stored.values() for t in named.values())


@given(at=st.integers(1, 3), kv_type=st.sampled_from(QUANTIZED))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hand_offs_move_codes_and_scales_and_match_single(tiny_model_factory, at, kv_type):
    """prefill_main on logical devices with a quantized KV, split at any layer: the hand-off copies codes
    and scales (``--dbg-handoff`` compares every stored tensor), logits bit-identical to single's."""
    path = tiny_model_factory(expert_type="Q8_0", n_layers=4)
    split = Engine.load(path, strategy="prefill_main", devices=["cpu", "cpu"], max_context=64, kv_block=4,
                        strategy_options={"split": str(at)}, dbg_handoff=True, kv_type=kv_type)
    single = Engine.load(path, max_context=64, kv_block=4, kv_type=kv_type)
    prompt = list(range(60, 71))
    results = []
    for engine in (split, single):
        a = engine.new_session()
        out = [engine.prefill(a, prompt)]
        out += [engine.decode_window([(a, 1)]) for _ in range(3)]
        results.append((out, a.kv))
    (got, kv), (want, _) = results
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert kv.home == {i: int(i >= at) for i in range(4)} and split.kv_pools.used(1) > 0
    assert set(split.kv_pools.pools[1].rows[3]) == {"k", "k_scale", "v", "v_scale"}


# --- errors ------------------------------------------------------------------------------------------------

def test_a_bad_kv_type_is_a_clear_error(tiny_model_factory):
    with pytest.raises(ValidationError, match="kv_type"):
        StrataSettings(kv_type="q4_0")
    with pytest.raises(ConfigError, match="unknown --kv-type 'q4_0'.*q8_0"):
        KVPools(16, 4, torch.float32, "q4_0")
    spec = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=64).spec
    wide = dataclasses.replace(spec, head_dim=48)
    one = tuple(LayerPlacement.local(0) for _ in range(spec.n_layers))
    with pytest.raises(ConfigError, match=r"--kv-type q8_0 needs rows of at most 32 values or a multiple of 32: "
                                          r"qwen3moe layer \d+: k \[2, 48\] has 48"):
        dense_bytes_per_device(wide, Placement(one, one), {0: DeviceSlot(0, torch.device("cpu"))}, torch.float32, 64,
                               "q8_0")
    assert dense_bytes_per_device(wide, Placement(one, one), {0: DeviceSlot(0, torch.device("cpu"))}, torch.float32,
                                  64, "int8")


# --- CUDA (the GPU suite) ------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_type", QUANTIZED)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_kv_on_cuda_is_within_the_tolerance_of_its_float_kv(tiny_model_factory, arch, kv_type):
    """On a GPU (bf16 compute; decode windows replayed as graphs where they apply, the eager layers with
    a quantized KV): prompts in chunks and batched decode windows within LOGIT_TOLERANCE of the bf16 KV."""
    path = _path(arch, tiny_model_factory)
    out = {}
    for t in ("auto", kv_type):
        engine = Engine.load(path, devices=["cuda:0"], max_context=512, kv_type=t, arena="pinned")
        if arch == "qwen3moe" and t in ("q8_0", "int8"):  # the fused decode's Triton kernels read the codes
            assert why_not_fused(engine.model, torch.device("cuda", 0)) is None
        a, b = engine.new_session(), engine.new_session()
        logits = [engine.prefill(a, PROMPT[:60], all_logits=True), engine.prefill(a, PROMPT[60:], all_logits=True),
                  engine.prefill(b, PROMPT[:40], all_logits=True)]
        logits += [engine.decode_window([(a, 5 + i), (b, 7 + i)]) for i in range(4)]
        out[t] = torch.cat(logits).float().cpu()
        engine.close()
    deviation = _deviation(out[kv_type], out["auto"])
    bound = LOGIT_TOLERANCE["fp8"] if kv_type == "fp8" else LOGIT_TOLERANCE["median"]
    assert deviation.median().item() <= bound, deviation.median().item()


# --- the fused decode ops over quantized pools ------------------------------------------------------------

def _quantized_pools(B: int, S: int, nkv: int, D: int, kv_type: str, block: int, seed: int):
    """Key / value codes and scales of random rows, each session's blocks in a shuffled order, and the table."""
    from test_decode_ops import _paged

    fmt = kv_format(kv_type)
    keys, values, table = _paged(B, S, nkv, D, seed, block)
    (kc, ks), (vc, vs) = quantize(keys, fmt), quantize(values, fmt)
    return kc, vc, ks, vs, table


@pytest.mark.parametrize("kv_type", QUANTIZED)
@pytest.mark.parametrize("D", [16, 64])
def test_the_fused_decode_ops_quantize_as_the_cache_and_attend_over_the_dequantized_rows(kv_type, D):
    from strata_core.ops.decode import decode_attention, rope_kv_write
    from strata_core.ops.decode_q import decode_attention_q, rope_kv_write_q

    B, nh, nkv, S = 3, 4, 2, 40
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen)
    qn, kn = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    positions = torch.tensor([0, 17, S - 1])
    kc, vc, ks, vs, blocks = _quantized_pools(B, S, nkv, D, kv_type, 8, 5)
    floats = [torch.zeros(kc.shape) for _ in range(2)]
    want_q = rope_kv_write(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, *floats, blocks, None)
    q = rope_kv_write_q(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, kc, vc, ks, vs, blocks, None)
    assert torch.equal(q, want_q)
    fmt = kv_format(kv_type)
    for b, p in enumerate(positions.tolist()):
        block, row = int(blocks[b, p // 8]), p % 8
        for codes, scales, rows in ((kc, ks, floats[0]), (vc, vs, floats[1])):
            want_codes, want_scales = quantize(rows[block, row], fmt)
            assert torch.equal(codes[block, row], want_codes) and torch.equal(scales[block, row], want_scales)
    got = decode_attention_q(q, positions, kc, vc, ks, vs, blocks, None)
    want = decode_attention(q, positions, dequantize(kc, ks), dequantize(vc, vs), blocks, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.strata.decode_attention_q.default, (q, positions, kc, vc, ks, vs, blocks, None))
    torch.library.opcheck(torch.ops.strata.rope_kv_write_q.default,
                          (qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, kc.clone(), vc.clone(), ks.clone(), vs.clone(),
                           blocks, None))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not HAS_TRITON,
                    reason="needs TRITON_INTERPRET=1 and a CPU Triton (on CUDA: the test below)")
# not fp8: the interpreter's e4m3 conversion drops the carry at the top of a binade (126.9 -> 64, not 128); the
# fp8 kernels are tested on CUDA by the test below
@pytest.mark.parametrize("kv_type", ["q8_0", "int8"])
@pytest.mark.parametrize(("D", "block"), [(16, 1), (32, 5), (64, 16), (128, 80)])
def test_the_quantized_decode_kernels_match_the_references_under_the_interpreter(kv_type, D, block):
    """The Triton kernels of rope_kv_write_q and decode_attention_q, run by Triton's interpreter on CPU
    tensors through an address table: the codes and scales they write equal the reference's, bit for bit,
    and what they attend equals the reference's within float rounding."""
    from strata_core.ops import decode_q

    B, nh, nkv, S = 3, 8, 2, 70
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=gen)
    qn, kn = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    positions = torch.tensor([0, 33, S - 1])
    pools = _quantized_pools(B, S, nkv, D, kv_type, block, 3)
    blocks = pools[-1]
    mine = [t.clone() for t in pools[:4]]
    table = decode_q.kv_table_q(*mine, list(blocks))
    rope = (scaled_inv_freq(D, 1e4, "yarn", 4.0, 32), 1.25) if block == 5 else (None, 1.0)  # a YaRN model's
    q = decode_q._rope_kv_q_cuda(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, *mine, None, table, *rope)
    want_q = decode_q.rope_kv_write_q(qkv, positions, qn, kn, 1e4, 1e-6, nh, nkv, *pools[:4], blocks, None, *rope)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    kc, vc, ks, vs = mine
    assert torch.equal(vc, pools[1]) and torch.equal(vs, pools[3])  # v is copied: the same bits
    # k is normed and rotated (the interpreter's RoPE tables round otherwise than torch's): a scale within
    # rounding, a code at most one step off
    torch.testing.assert_close(ks, pools[2], rtol=1e-5, atol=0)
    assert (kc.int() - pools[0].int()).abs().max() <= 1
    out = decode_q._attention_q_cuda(want_q, positions, *mine, None, table)
    torch.testing.assert_close(out, decode_q.decode_attention_q(want_q, positions, *mine, blocks, None),
                               rtol=1e-5, atol=1e-6)


#: the quantized attention kernel's deviation from the reference, relative to the output's largest value.
#: float32: IEEE products; the kernel rounds each group's sum of q x codes times its scale, and each
#: probability times its value scale, where the reference rounds each code times its scale: as many
#: roundings of float32, in other places. bf16 / float16: the reference rounds each dequantized value to
#: the compute dtype (2**-9 relative for bf16) and sums in float32; the kernel's key products are exact
#: (codes and q in the dot, the scale after it) and each probability times its value scale is rounded
#: to bf16 once: a bf16 rounding of each value's term, as the bf16 kernel's rounded probabilities against
#: its reference, whose bound (tests/test_decode_ops_cuda.py) this is.
ATTENTION_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_the_quantized_attention_kernel_on_cuda_matches_the_reference(kv_type, dtype):
    """The CUDA decode attention over quantized pools (the scales after the dots) against the CPU reference,
    over 9000 positions of shuffled blocks (many splits)."""
    from strata_core.ops import decode_q

    if not decode_q.fused_quantized_supported(kv_type, 128, torch.device("cuda", 0)):
        pytest.skip(f"the Triton kernels do not serve {kv_type} on this GPU")
    B, nh, nkv, D, S = 3, 32, 4, 128, 9000
    pools = _quantized_pools(B, S, nkv, D, kv_type, 16, 7)
    q = torch.randn(B, nh, D, generator=torch.Generator().manual_seed(8)).to(dtype)
    positions = torch.tensor([0, 1023, S - 1])
    got = decode_q.decode_attention_q(q.cuda(), positions.cuda(), *[t.cuda() for t in pools], None).cpu()
    want = decode_q.decode_attention_q(q, positions, *pools, None)
    deviation = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert deviation <= ATTENTION_TOL[dtype], deviation


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kv_type", QUANTIZED)
def test_fused_layers_over_a_quantized_kv_match_the_eager_layers(tiny_model_factory, device, kv_type):
    """The fused decode layers (on the CPU their references, on CUDA the Triton kernels) over a quantized
    KV against the eager layers: the same output and the same stored rows, within float rounding."""
    from strata_core.runtime.session import DecodeBatch

    engine = Engine.load(tiny_model_factory(expert_type="Q4_0", n_layers=3), devices=[device], max_context=64,
                         dtype="float32", kv_type=kv_type)
    prompts = [list(range(5, 30)), list(range(40, 52))]
    sessions = []
    for _ in range(2):
        sessions.append([engine.new_session() for _ in prompts])
        for session, prompt in zip(sessions[-1], prompts):
            engine.prefill(session, prompt)
    tokens = torch.tensor([3, 9])
    (segment,) = engine.runner.segments("decode")
    hidden = engine.runner.embed(tokens, torch.device(device))
    eager = engine.runner.decode_layers(segment, hidden, DecodeBatch(tuple(sessions[0]), tokens), fused=False)
    fused = engine.runner.decode_layers(segment, hidden, DecodeBatch(tuple(sessions[1]), tokens), fused=True)
    # a k rounded otherwise by the fused norm and RoPE can land one code step off: a step of the output
    torch.testing.assert_close(fused, eager, rtol=1e-3, atol=3e-3)
    step = 0.13 if kv_type == "fp8" else 1e-4  # fp8's step: up to 2**-3 of a value
    for a, b in zip(*sessions):
        for layer in segment.layers:
            for x, y in zip(a.kv.read(layer, a.n_tokens + 1), b.kv.read(layer, b.n_tokens + 1)):
                assert isinstance(x, QuantizedRows) and isinstance(y, QuantizedRows)
                assert (x.codes.int() - y.codes.int()).abs().max() <= 1  # a k rounded otherwise: one step at most
                torch.testing.assert_close(y.rows(0, a.n_tokens + 1, torch.float32),
                                           x.rows(0, a.n_tokens + 1, torch.float32), rtol=step, atol=2e-2)
