"""`strata gate` on cpu,cpu with the demo model: every installed topology IDENTICAL to single with the
same expert set; a difference is named (strategy, prompt, position) and exits 1. Across two ranks
(two local processes): IDENTICAL on rank 0, and the strategies that read another rank's memory refused."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from pydantic import Field

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.plugin import GateLayout, Placement, StrategyOptions, StrategySpec, hookimpl
from strata_core.plugin.manager import build_plugin_manager
from strata_core.tools import gate
from strata_core.tools.serve_launcher import free_port


def test_the_gate_passes_every_installed_topology_on_logical_devices():
    """No --strategies: every installed strategy is gated, the example third-party one included."""
    installed = [name for name in build_plugin_manager().strategies if name != "single"]
    assert "even_split" in installed and len(installed) >= 5
    result = subprocess.run([sys.executable, "-m", "strata_core", "gate", "--devices", "cpu,cpu", "--prompts", "math",
                             "--tokens", "4"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gate: 1 prompt(s) x 4 tokens, greedy; 16 of 32 experts (4 layers x 8)")
    for strategy in installed:
        assert f"{strategy:<14} IDENTICAL" in lines
    assert not any("declares no gate options" in line for line in lines)
    assert lines[-1] == "gate: IDENTICAL"


def _halves(declare: bool) -> types.ModuleType:
    """A strategy ``halves``: two stages cut at ``cut`` (default 1, which would not hold single's
    experts); with ``declare`` its spec tells the gate to cut in the middle."""
    module = types.ModuleType("strata_halves")

    class HalvesOptions(StrategyOptions):
        cut: int = Field(1, ge=1)

    def gate_options(layout: GateLayout) -> dict[str, int]:
        return {"cut": layout.n_layers // 2}

    @hookimpl
    def strata_register_strategies(register):
        register(StrategySpec(name="halves", description="two stages", plugin=module, options=HalvesOptions,
                              gate_options=gate_options if declare else None))

    @hookimpl
    def strata_topology(devices, spec, settings, options):
        return Placement.stages([(0, range(options.cut)), (1, range(options.cut, spec.n_layers))])

    module.strata_register_strategies, module.strata_topology = strata_register_strategies, strata_topology
    return module


def _install(monkeypatch, module: types.ModuleType) -> None:
    """Every plugin manager the engine and the gate build also has ``module``."""
    def with_module(settings=None):
        pm = build_plugin_manager(settings)
        pm.register_plugin(module, name=module.__name__, distribution="test")
        return pm

    monkeypatch.setattr("strata_core.engine_load.build_plugin_manager", with_module)
    monkeypatch.setattr("strata_core.tools.gate.build_plugin_manager", with_module)


def test_a_spec_declared_gate_setting_is_used_without_naming_the_strategy(monkeypatch, capsys):
    _install(monkeypatch, _halves(declare=True))
    from strata_core.cli import main

    assert main(["gate", "--devices", "cpu,cpu", "--prompts", "math", "--tokens", "2"]) == 0  # a difference exits 1
    lines = capsys.readouterr().out.splitlines()
    assert "halves         IDENTICAL" in lines and "even_split     IDENTICAL" in lines
    assert lines[-1] == "gate: IDENTICAL"


def test_a_strategy_without_gate_options_runs_its_defaults_and_says_so(monkeypatch, capsys):
    _install(monkeypatch, _halves(declare=False))
    results = gate.run_gate(StrataSettings(devices=["cpu", "cpu"]), ["halves"], ["math"], 2, None,
                            Engine.from_settings)
    out = capsys.readouterr().out
    assert "halves         declares no gate options: its default options, 8 experts per slot" in out
    assert [r.strategy for r in results] == ["halves"] and not results[0].expert_set
    assert "halves         DIFFERENT EXPERT SET (not comparable)" in out


def test_more_experts_than_the_model_has_is_one_line_and_exit_2(capsys):
    from strata_core.cli import main

    assert main(["gate", "--devices", "cpu,cpu", "--prompts", "math", "--tokens", "2", "--experts", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "strata: error: gate: --experts 64 is more than the model has (4 layers x 8 = 32)"


def test_a_difference_names_the_first_token_and_fails(monkeypatch, capsys):
    """A strategy whose third token differs is reported with its prompt and position; the CLI exits 1."""
    real = gate.greedy_tokens

    def skewed(engine, ids, n):
        tokens = real(engine, ids, n)
        if engine.settings.strategy == "layer_split":
            tokens[2] += 1
        return tokens

    monkeypatch.setattr(gate, "greedy_tokens", skewed)
    from strata_core.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["gate", "--devices", "cpu,cpu", "--strategies", "single,layer_split,peer_tier", "--prompts", "math",
              "--tokens", "3"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "layer_split    DIFFERS: prompt math, token 2:" in out and "peer_tier      IDENTICAL" in out


def test_every_strategy_gets_single_s_expert_set():
    settings = StrataSettings(devices=["cpu"], expert_cache=3)
    layout = gate.gate_layout(None, 4, 8)
    assert (layout.slots, layout.experts_per_slot) == (2, 8)
    union = {}
    for strategy in build_plugin_manager(settings).strategies.values():
        engine = Engine.from_settings(gate.gate_settings(settings, strategy, layout))
        assert engine.settings.adapt_swaps == 0 and len(engine.devices) == (1 if strategy.name == "single" else 2)
        union[strategy.name] = set().union(*(set(t.resident()) for t in engine.experts.tables.values()))
        engine.close()
    assert "even_split" in union and len(union["single"]) == 16
    assert all(held == union["single"] for held in union.values())


def test_across_ranks_strategies_that_read_another_rank_s_memory_are_refused():
    """peer_tier and gpu1_experts would read across to another rank: refused before anything loads."""
    settings = StrataSettings(devices=["cpu", "rank1:cpu"], nnodes=2, dist_init_addr="127.0.0.1:1")
    layout, specs = gate._plan(settings, ["layer_split", "prefill_main"], None, rank=0)
    assert [s.name for s in specs] == ["single", "layer_split", "prefill_main"] and layout.experts_per_slot == 8
    with pytest.raises(ConfigError, match=r"gate: across ranks no rank reads another's memory, so these strategies "
                                          r"cannot run: peer_tier \(placement: .* a device of another rank\); "
                                          r"gpu1_experts \(.*\); name the others with --strategies"):
        gate._plan(settings, ["layer_split", "peer_tier", "gpu1_experts"], None, rank=1)


def test_the_gate_across_two_ranks_prints_identical_on_rank_0():
    """Two local processes joined by gloo: rank 0 prints the gate, rank 1 serves each strategy's stages."""
    port = str(free_port())

    def rank(r: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "strata_core", "gate", "--devices", "cpu,rank1:cpu",
                                 "--strategies", "layer_split,prefill_main", "--prompts", "math", "--tokens", "4",
                                 "--nnodes", "2", "--node-rank", str(r), "--dist-init-addr", f"127.0.0.1:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))

    ranks = [rank(0), rank(1)]
    try:
        (out, err), (_, err1) = (process.communicate(timeout=300) for process in ranks)
    finally:
        for process in ranks:
            process.kill()
    assert ranks[0].returncode == 0 and ranks[1].returncode == 0, err[-2000:] + err1[-2000:]
    lines = out.splitlines()
    assert "single         reference (cpu)" in lines
    assert "layer_split    IDENTICAL" in lines and "prefill_main   IDENTICAL" in lines and lines[-1] == "gate: IDENTICAL"
