"""The fixtures strata_core.testing gives plugin authors work as documented."""

from __future__ import annotations

import torch

from strata_core.engine import Engine
from strata_core.gguf.reader import GGUFFile


def test_tiny_model_in_each_block_format(tiny_model_path, tiny_model_factory):
    gguf_file = GGUFFile.open(tiny_model_path)
    expert_types = {ref.qtype.name for name, ref in gguf_file.tensors.items() if name.endswith("_exps.weight")}
    assert len(expert_types) == 1
    reference = Engine.load(tiny_model_factory(expert_type="F32")).logits([3, 4, 5, 6])
    logits = Engine.load(tiny_model_path).logits([3, 4, 5, 6])
    assert torch.isfinite(logits).all()
    tolerance = {"F32": 0.0, "F16": 0.05, "Q8_0": 1.0}[expert_types.pop()]
    assert (logits - reference).abs().max() <= tolerance


def test_logical_devices_are_two_names_of_one_device(logical_devices):
    assert len(logical_devices) == 2 and logical_devices[0] == logical_devices[1]


def test_register_strategy_is_undone(plugin_manager, register_strategy):
    import sys
    import types

    from strata_core.plugin import StrategySpec, hookimpl

    module = types.ModuleType("fixture_probe")

    @hookimpl
    def strata_register_strategies(register):
        register(StrategySpec(name="probe", description="probe", plugin=sys.modules.get("fixture_probe", module)))

    module.strata_register_strategies = strata_register_strategies
    register_strategy(module, "fixture_probe")
    assert plugin_manager.strategy("probe").plugin is module
