"""The engine's CPU expert paths through the CPU kernels: used on ``--devices cpu``, the same logits as the
reference dequantize + matmul within float tolerance (the float bodies), the int8 body's within the CUDA q8
kernels' tolerance of theirs, bit-identical whichever CPU path computes a row, and the reference when the
kernels cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata_core.engine import Engine
from strata_core.experts import cpu_ffn, device_rows
from strata_core.ops import cpu_kernels as kernels
from strata_core.testing.cpu_isa import float_cpu_bodies
from strata_core.tools.synthetic import PRESETS, write_synthetic

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
DECODE = [26, 43, 38, 32, 79]
Q8_TOL = 2e-2  # relative (Frobenius), the CUDA q8 kernels' (tests/test_moe_q8.py)
OTHER = [7, 61, 5, 88, 23]  # a second session's prompt

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels(), reason="the CPU kernels did not build (see the warning)")


@pytest.fixture(scope="module", params=[Q.Q4_K, Q.Q6_K])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu-experts") / f"tiny-{request.param.name}.gguf"
    write_synthetic(path, PRESETS["tiny"], expert_type=request.param, dense_type=Q.Q8_0, progress=False)
    return path


def _logits(engine: Engine) -> torch.Tensor:
    """Prompt logits, then decode windows of one session."""
    session = engine.new_session()
    logits = [engine.prefill(session, PROMPT, all_logits=True)]
    logits += [engine.decode_window([(session, token)]) for token in DECODE]
    return torch.cat(logits)


@pytest.mark.usefixtures("float_cpu_kernels")  # against the reference dequantize + matmul: the float bodies (the int8 one: test_the_int8_body_end_to_end)
def test_cpu_engine_computes_its_experts_with_the_kernels(model, monkeypatch, one_thread):
    calls = []
    grouped, slots, slot_ffn = cpu_ffn.qlinear_grouped, cpu_ffn.qlinear_slots, cpu_ffn.slot_ffn_cpu
    monkeypatch.setattr(cpu_ffn, "qlinear_grouped", lambda *args: calls.append(args[3]) or grouped(*args))
    monkeypatch.setattr(cpu_ffn, "qlinear_slots", lambda *args: calls.append(args[5]) or slots(*args))
    monkeypatch.setattr(cpu_ffn, "slot_ffn_cpu", lambda *args: calls.extend(args[5]) or slot_ffn(*args))
    routed = device_rows.route_slot_ffn_cpu  # a layer's routed experts in one call, its routing with them
    monkeypatch.setattr(device_rows, "route_slot_ffn_cpu",
                        lambda *args, **kw: calls.extend(args[10]) or routed(*args, **kw))
    got = _logits(Engine.load(model, max_context=64))
    assert calls and all(qtype in kernels.CPU_KERNEL_TYPES for qtype in calls)
    monkeypatch.setattr(cpu_ffn, "has_cpu_kernel", lambda qtypes, shapes: False)
    want = _logits(Engine.load(model, max_context=64))  # the reference dequantize + matmul
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("options", [{"expert_cache": 0, "pcie_frac": 0.0}, {"expert_cache": 5, "pcie_frac": 0.5},
                                     {"expert_cache": 5, "arena": "pinned", "gather": True}])
def test_every_cpu_path_gives_the_resident_bits(model, options, one_thread):
    """Misses computed from the arena in place (all, or a share beside the link) or the per-pair decode
    gather: logits bit-identical to every expert resident."""
    options = dict(options)
    gather = options.pop("gather", False)
    engine = Engine.load(model, max_context=64, **options)
    if gather:
        engine.experts.use_gather(True)
    got = _logits(engine)
    assert torch.equal(got, _logits(Engine.load(model, max_context=64)))
    if options.get("pcie_frac", 1.0) < 1:
        assert engine.telemetry.snapshot()["experts_cpu"] > 0


@pytest.mark.skipif(not kernels.int8_activations([Q.Q4_K, Q.Q6_K]), reason="no AVX-512 VNNI here")
def test_the_int8_body_end_to_end(model, one_thread):
    """The engine's experts on the int8 body (the default where the CPU has AVX-512 VNNI): prompt and decode
    logits within a relative (Frobenius) Q8_TOL of the float bodies', and still the same bits whichever CPU
    path computes a row (misses from the arena in place, a session batched with another or alone).

    The bound: rounding 32 values to int8 codes of ``max |v| / 127`` moves each by at most half a code, so
    a block's relative error is at most sqrt(32) / 254 = 2.2e-2 (about 0.7% on these activations: a code
    over sqrt(12) against their rms), the CUDA q8 kernels' tolerance; a product's error is its input's,
    and this 2-layer model carries it to the logits about one for one (0.1% to 0.8% measured)."""
    got = _logits(Engine.load(model, max_context=64))
    with float_cpu_bodies():
        want = _logits(Engine.load(model, max_context=64))
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < Q8_TOL
    assert not torch.equal(got, want)  # the int8 body ran
    assert torch.equal(_logits(Engine.load(model, max_context=64, expert_cache=0, pcie_frac=0.0)), got)
    engine = Engine.load(model, max_context=64)
    one, other = engine.new_session(), engine.new_session()
    engine.prefill_batch([(one, PROMPT), (other, OTHER)])
    batched = [engine.decode_window([(one, token), (other, token)]) for token in DECODE]  # [2, V] each
    assert torch.equal(torch.stack([rows[0] for rows in batched]), got[len(PROMPT):])


def test_without_a_compiler_the_reference_runs_with_one_warning(monkeypatch, caplog):
    def no_compiler(**kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.cpu_kernels.__wrapped__() is False
    assert "torch reference computes CPU experts" in caplog.text and "No such file" in caplog.text


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
    assert kernels.cpu_kernels.__wrapped__() is False
