"""The plugin contract: every installed strategy and observer reads only ``PhaseContext`` members,
and the plugin distributions (package code and tests) import only the contract's modules."""

from __future__ import annotations

import ast
import types
from pathlib import Path

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


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_a_prompt_batch_the_logits_of_its_chunks_alone(tiny_model_factory, strategy):
    """The three prompts as one prompt batch (a server step starting three requests), then windows:
    the logits of each prompt prefilled alone, bit for bit, through the contract's ctx."""
    path = tiny_model_factory(expert_type="Q4_0")
    engine = Engine.load(path, devices=["cpu", "cpu"], max_context=64, prefill_chunk=64, expert_cache=4,
                         strategy=strategy)
    want = _run(engine)
    sessions = [engine.new_session() for _ in PROMPTS]
    with strict_context(engine):
        first = engine.prefill_batch(list(zip(sessions, PROMPTS)))
        got = list(first)
        tokens = [int(row.argmax()) for row in first]
        for _ in range(3):
            rows = engine.decode_window(list(zip(sessions, tokens)))
            got.extend(rows)
            tokens = [int(row.argmax()) for row in rows]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_plugin_reading_outside_the_contract_fails_naming_the_member(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q4_0"), devices=["cpu"], max_context=64)
    module = types.ModuleType("nosy")
    module.strata_prefill = hookimpl(tryfirst=True)(lambda ctx, batch, logits: ctx.model)
    engine.plugins.register(module, name="nosy")
    with strict_context(engine), pytest.raises(ContractViolation, match=r"ctx\.model"):
        engine.prefill(engine.new_session(), PROMPTS[0])
    assert engine.runner.context is engine.runner  # outside the block the runner itself is ctx


ROOT = Path(__file__).resolve().parents[1]
#: the strata_core modules a plugin and its tests may import (each with its submodules)
PUBLIC_MODULES = ("strata_core.plugin", "strata_core.testing", "strata_core.engine", "strata_core.errors")
#: the plugin distributions: every folder of plugins/, and the examples that are one (a pyproject.toml)
PLUGIN_DIRS = sorted({*(p for p in ROOT.glob("plugins/*") if p.is_dir()),
                      *(p.parent for p in ROOT.glob("examples/*/pyproject.toml"))})


def _public(module: str) -> bool:
    return module == "strata_core" or any(module == m or module.startswith(m + ".") for m in PUBLIC_MODULES)


def _is_submodule(name: str) -> bool:
    """Whether ``strata_core.<name>`` is a module (not a name ``strata_core`` exports, like ``Engine``)."""
    core = ROOT / "strata_core"
    return (core / f"{name}.py").is_file() or (core / name / "__init__.py").is_file()


def forbidden_imports(source: str, filename: str) -> list[str]:
    """The imports in ``source`` of strata_core modules outside ``PUBLIC_MODULES``, as ``file:line: import``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "strata_core":
                modules = [f"strata_core.{a.name}" for a in node.names if _is_submodule(a.name)]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and ast.unparse(node.func) in (
                  "importlib.import_module", "import_module", "__import__")):
            modules = [node.args[0].value]
        for module in modules:
            if (module == "strata_core" or module.startswith("strata_core.")) and not _public(module):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_import_check_finds_core_internals():
    bad = ("from strata_core.experts.peer import PeerLane\nimport strata_core.gguf.reader\n"
           "from strata_core import experts\nimportlib.import_module('strata_core.runtime.session')\n")
    good = ("import strata_core\nfrom strata_core import Engine\nfrom strata_core.plugin import hookimpl\n"
            "from strata_core.plugin.memory import GIB\nfrom strata_core.testing.sync import HostReads\n"
            "from strata_core.engine import Engine\nfrom strata_core.errors import ConfigError\n"
            "from strata_layer_split.plugin import stage_ranges\nfrom . import plugin\nimport torch\n")
    assert [line.split(": ", 1)[0] for line in forbidden_imports(bad, "bad.py")] == [f"bad.py:{n}" for n in (1, 2, 3, 4)]
    assert forbidden_imports(good, "good.py") == []


def test_plugins_and_their_tests_import_only_the_contract():
    """Every module of every plugin distribution (its package and its tests) imports from strata_core
    only ``strata_core`` itself, ``strata_core.plugin``, ``strata_core.testing``, the public
    ``strata_core.engine`` and ``strata_core.errors``: what a third-party plugin can rely on. (A
    plugin may import its base strategy's package and anything outside strata_core.)"""
    assert {p.name for p in PLUGIN_DIRS} >= {"layer_split", "peer_tier", "gpu1_experts", "prefill_main",
                                              "strata-even-split"}
    files = [f for d in PLUGIN_DIRS for f in sorted(d.rglob("*.py")) if "build" not in f.relative_to(d).parts]
    assert len(files) >= 2 * len(PLUGIN_DIRS)  # a package and tests each
    found = [line for f in files for line in forbidden_imports(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "plugins import core internals:\n" + "\n".join(found)
