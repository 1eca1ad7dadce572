"""The plugin contract: every installed strategy and observer reads only ``PhaseContext`` members."""

from __future__ import annotations

import types

import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.plugin import CONTEXT_MEMBERS, PhaseContext, hookimpl
from strata_core.plugin.manager import build_plugin_manager
from strata_core.testing.contract import ContractViolation, strict_context

PROMPTS = [list(range(5, 30)), list(range(40, 52)), list(range(60, 69))]
STRATEGIES = sorted(build_plugin_manager(StrataSettings()).strategies)
OBSERVERS = dict(prefill_timing=True, decode_timing=True, dbg_nan=True, dbg_handoff=True)


def _run(engine: Engine, windows: int = 3) -> list[torch.Tensor]:
    """Prompts of three sessions (two chunks each), then batched greedy windows: every logit row."""
    sessions = [engine.new_session() for _ in PROMPTS]
    out = [engine.prefill(s, p) for s, p in zip(sessions, PROMPTS)]
    tokens = [int(row.argmax()) for row in out]
    for _ in range(windows):
        rows = engine.decode_window(list(zip(sessions, tokens)))
        out.extend(rows)
        tokens = [int(row.argmax()) for row in rows]
    return out


def test_the_contract_lists_the_protocol_s_members():
    assert {"devices", "placement", "main", "options", "settings", "segments", "device_of", "embed",
            "prefill_segment", "decode_segment", "head", "run_prompt", "run_decode", "observe_layers",
            "time_stages", "telemetry"} == CONTEXT_MEMBERS
    assert all(getattr(PhaseContext, name, None) is None or getattr(PhaseContext, name).__doc__
               for name in CONTEXT_MEMBERS)  # every method and property documented


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_installed_strategy_keeps_to_the_contract(tiny_model_factory, strategy, capsys):
    """Each strategy, with every observer on, runs prompts and windows through a ctx that answers only
    the contract's members, and gives the logits it gives with the plain runner."""
    path = tiny_model_factory(expert_type="Q4_0")
    settings = dict(max_context=64, prefill_chunk=16, expert_cache=4, strategy=strategy)
    want = _run(Engine.load(path, devices=["cpu", "cpu"], **settings))
    engine = Engine.load(path, devices=["cpu", "cpu"], **settings, **OBSERVERS)
    with strict_context(engine) as ctx:
        got = _run(engine)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {"observe_layers", "time_stages", "telemetry"} <= ctx.read  # the observers went through it
    assert "[strata decode]" in capsys.readouterr().err


def test_a_plugin_reading_outside_the_contract_fails_naming_the_member(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0"), devices=["cpu"], max_context=64)
    module = types.ModuleType("nosy")
    module.strata_prefill = hookimpl(tryfirst=True)(lambda ctx, session, tokens, logits: ctx.model)
    engine.plugins.register(module, name="nosy")
    with strict_context(engine), pytest.raises(ContractViolation, match=r"ctx\.model"):
        engine.prefill(engine.new_session(), PROMPTS[0])
    assert engine.runner.context is engine.runner  # outside the block the runner itself is ctx
