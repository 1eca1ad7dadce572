"""`strata gate` on cpu,cpu with the demo model: every installed topology IDENTICAL to single with the
same expert set; a difference is named (strategy, prompt, position) and exits 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata_core.tools import gate
from strata_core.config import StrataSettings
from strata_core.engine import Engine

STRATEGIES = "single,peer_tier,gpu1_experts,layer_split,prefill_main"


def test_the_gate_passes_every_topology_on_logical_devices():
    result = subprocess.run([sys.executable, "-m", "strata_core", "gate", "--devices", "cpu,cpu", "--strategies",
                             STRATEGIES, "--prompts", "math", "--tokens", "4"],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gate: 1 prompt(s) x 4 tokens, greedy;")
    for strategy in STRATEGIES.split(",")[1:]:
        assert f"{strategy:<14} IDENTICAL" in lines
    assert lines[-1] == "gate: IDENTICAL"


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
    n_layers = 4
    union = {}
    for strategy in STRATEGIES.split(","):
        engine = Engine.from_settings(gate.gate_settings(settings, strategy, 16, n_layers))
        union[strategy] = set().union(*(set(t.resident()) for t in engine.experts.tables.values()))
        assert engine.settings.adapt_swaps == 0 and len(engine.devices) == (1 if strategy == "single" else 2)
        engine.close()
    assert all(held == union["single"] for held in union.values()) and len(union["single"]) == 16
