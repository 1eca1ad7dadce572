"""Observer plugins under any strategy: the timing printout and the NaN guard."""

from __future__ import annotations

import pytest
import torch

from strata_core.engine import Engine
from strata_core.observers.nan_guard import NonFiniteError


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(n_layers=3)


@pytest.mark.parametrize("strategy, devices", [("single", ["cpu"]), ("even_split", ["cpu", "cpu"])])
def test_nan_guard_names_the_first_non_finite_layer(model, strategy, devices):
    engine = Engine.load(model, strategy=strategy, devices=devices, dbg_nan=True)
    engine.model.weights.at(1, "cpu")["attn_output.weight"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="prefill: layer 1 output is non-finite"):
        engine.logits([1, 2, 3])


def test_nan_guard_is_silent_on_a_healthy_model_and_off_by_default(model):
    guarded = Engine.load(model, dbg_nan=True)
    plain = Engine.load(model)
    assert torch.equal(guarded.logits([4, 5, 6]), plain.logits([4, 5, 6]))
    assert not plain.plugins.has_plugin("strata_core.observers.nan_guard")
    assert plain.runner.observers == () and guarded.runner.observers == ()


def test_timing_prints_one_line_per_chunk_and_window(model, capsys):
    engine = Engine.load(model, prefill_timing=True, decode_timing=True, prefill_chunk=4)
    session = engine.new_session()
    engine.prefill(session, list(range(10)))
    engine.decode_window([(session, 11)])
    lines = capsys.readouterr().err.splitlines()
    prefill = [line for line in lines if line.startswith("[strata prefill]")]
    decode = [line for line in lines if line.startswith("[strata decode]")]
    assert [line.split()[2] for line in prefill] == ["tokens=4", "tokens=4", "tokens=2"]
    assert len(decode) == 1 and "host=" in decode[0] and "device=" in decode[0]
