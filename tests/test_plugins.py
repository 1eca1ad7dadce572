"""The plugin manager: discovery, strategy selection and blocking, helpful errors, observers."""

from __future__ import annotations

import types

import pytest

from strata_core.plugin import hookspecs
from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.plugin import StrategyOptions, StrategySpec, hookimpl
from strata_core.plugin.manager import build_plugin_manager


def make_strategy_plugin(name: str, answer: str, base: str | None = None, options=StrategyOptions):
    module = types.ModuleType(f"fake_{name}")

    @hookimpl
    def strata_register_strategies(register):
        register(StrategySpec(name=name, description=f"{name} strategy", plugin=module, base=base,
                              options=options))

    @hookimpl
    def strata_hand_off(ctx, session, layers, src, dst):
        return answer

    module.strata_register_strategies = strata_register_strategies
    module.strata_hand_off = strata_hand_off
    return module


def call_hand_off(pm):
    return pm.hook.strata_hand_off(ctx=None, session=None, layers=range(0), src="cpu", dst="cpu")


def test_single_is_builtin(plugin_manager):
    assert plugin_manager.strategy("single").distribution == "strata (builtin)"


def test_names_are_normalised(plugin_manager, register_strategy):
    register_strategy(make_strategy_plugin("Peer-Tier", "peer"), "peer")
    assert plugin_manager.strategy("peer_tier").name == "peer_tier"
    assert plugin_manager.strategy("peer-tier").name == "peer_tier"


def test_selecting_blocks_other_strategies(plugin_manager, register_strategy):
    register_strategy(make_strategy_plugin("alpha", "alpha"), "alpha")
    register_strategy(make_strategy_plugin("beta", "beta"), "beta")
    plugin_manager.select_strategy("alpha")
    assert call_hand_off(plugin_manager) == "alpha"
    assert plugin_manager.is_blocked("beta")
    assert plugin_manager.is_blocked("strata_core.strategies.single")


def test_derived_strategy_answers_before_its_base(plugin_manager, register_strategy):
    register_strategy(make_strategy_plugin("derived", "derived", base="base"), "derived")
    register_strategy(make_strategy_plugin("base", "base"), "base")
    plugin_manager.select_strategy("derived")
    assert call_hand_off(plugin_manager) == "derived"
    assert not plugin_manager.is_blocked("base")


def test_unknown_strategy_lists_installed(plugin_manager):
    with pytest.raises(ConfigError, match=r"unknown strategy 'nope'.*single"):
        plugin_manager.select_strategy("nope")


def test_two_plugins_claiming_one_name_name_both(plugin_manager, register_strategy):
    register_strategy(make_strategy_plugin("twin", "a"), "twin_a", distribution="dist-a")
    with pytest.raises(ConfigError, match="dist-a.*dist-b"):
        register_strategy(make_strategy_plugin("twin", "b"), "twin_b", distribution="dist-b")


def test_strategy_options_are_validated(plugin_manager, register_strategy):
    class SplitOptions(StrategyOptions):
        split_at: int = 1

    register_strategy(make_strategy_plugin("split", "split", options=SplitOptions), "split")
    assert plugin_manager.select_strategy("split", {"split_at": 3}).options.split_at == 3
    with pytest.raises(ConfigError, match="bogus"):
        plugin_manager.select_strategy("split", {"bogus": 1})


def test_observers_register_only_when_switched_on():
    quiet = build_plugin_manager(StrataSettings(disable_plugin_autoload=True))
    loud = build_plugin_manager(StrataSettings(disable_plugin_autoload=True, dbg_nan=True, decode_timing=True))
    assert not quiet.has_plugin("strata_core.observers.nan_guard")
    assert loud.has_plugin("strata_core.observers.nan_guard")
    assert loud.has_plugin("strata_core.observers.timing")


def test_every_hook_is_documented():
    for name in dir(hookspecs):
        if name.startswith("strata_"):
            doc = getattr(hookspecs, name).__doc__ or ""
            assert ":param" in doc and ":return:" in doc and "Invariant" in doc, name


def test_entry_point_discovery_and_broken_plugin_guard(monkeypatch, caplog):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data" / "fake_dist"))
    pm = build_plugin_manager(StrataSettings())
    spec = pm.strategy("fake_strategy")
    assert spec.distribution == "strata-fake"
    assert "skipping plugin broken from strata-fake" in caplog.text


def test_allow_list_and_autoload_switch(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "data" / "fake_dist"))
    assert "fake_strategy" not in build_plugin_manager(StrataSettings(disable_plugin_autoload=True)).strategies
    assert "fake_strategy" not in build_plugin_manager(StrataSettings(plugins=["other"])).strategies
    assert "fake_strategy" in build_plugin_manager(StrataSettings(plugins=["strata-fake"])).strategies
