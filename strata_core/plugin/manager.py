"""The plugin manager: builtins + the entry-point group ``strata``, strategy selection.

Discovery registers the core defaults (the phase hooks that execute a placement, ``trylast``),
then every plugin so that each can declare its strategies through ``strata_register_strategies``. Selecting a strategy then keeps exactly one chain of strategy
plugins (the selected one and the strategies it builds on, base first) and blocks the others, so
every firstresult phase hook has one answer. Observers are registered only when switched on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass, replace

import pluggy

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError, one_line
from strata_core.plugin import hookspecs
from strata_core.plugin.spec import (
    PROJECT_NAME,
    StrategyOptions,
    StrategySpec,
    normalize_strategy_name,
)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "strata"
CORE_DEFAULTS_MODULE = "strata_core.plugin.defaults"
BUILTIN_STRATEGY_MODULES = ("strata_core.strategies.single",)
BUILTIN_DISTRIBUTION = "strata (builtin)"

#: observer module -> the setting that switches it on
OBSERVER_MODULES = {
    "strata_core.observers.timing": ("prefill_timing", "decode_timing"),
    "strata_core.observers.nan_guard": ("dbg_nan",),
}


@dataclass(frozen=True)
class SelectedStrategy:
    """The strategy in effect and its validated options."""

    spec: StrategySpec
    options: StrategyOptions


class StrataPluginManager(pluggy.PluginManager):
    """A pluggy manager that knows Strata's strategies and where each came from."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.strategies: dict[str, StrategySpec] = {}
        self.distributions: dict[str, str] = {}  # plugin name -> distribution it came from

    def register_plugin(self, plugin: object, name: str, distribution: str) -> None:
        """Register ``plugin`` and collect the strategies it declares."""
        self.register(plugin, name=name)
        self.distributions[name] = distribution
        collected: list[StrategySpec] = []
        for impl in self.hook.strata_register_strategies.get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=collected.append)
        for spec in collected:
            self._add_strategy(replace(spec, distribution=distribution))

    def _add_strategy(self, spec: StrategySpec) -> None:
        existing = self.strategies.get(spec.name)
        if existing is not None and existing.plugin is not spec.plugin:
            raise ConfigError(
                f"strategy {spec.name!r} is provided by two plugins: "
                f"{existing.distribution} and {spec.distribution}"
            )
        self.strategies[spec.name] = spec

    def strategy(self, name: str) -> StrategySpec:
        """The spec of strategy ``name``; an unknown name lists the installed ones."""
        key = normalize_strategy_name(name)
        if key not in self.strategies:
            installed = ", ".join(sorted(self.strategies)) or "none"
            raise ConfigError(f"unknown strategy {name!r}; installed strategies: {installed}")
        return self.strategies[key]

    def select_strategy(self, name: str, options: dict[str, object] | None = None) -> SelectedStrategy:
        """Keep the chain of ``name`` (base first) registered, block every other strategy plugin."""
        chain = self._chain(self.strategy(name))
        keep = {id(spec.plugin) for spec in chain}
        for spec in self.strategies.values():
            plugin_name = self.get_name(spec.plugin)
            if plugin_name is not None and id(spec.plugin) not in keep:
                self.unregister(spec.plugin)
                self.set_blocked(plugin_name)
        for spec in chain:  # re-register base first so the selected strategy answers first (LIFO)
            plugin_name = self.get_name(spec.plugin)
            if plugin_name is not None:
                self.unregister(spec.plugin)
                self.register(spec.plugin, name=plugin_name)
        selected = chain[-1]
        try:
            validated = selected.options.model_validate(options or {})
        except Exception as error:  # pydantic ValidationError: name the strategy and the option
            fields = ", ".join(selected.options.model_fields) or "none"
            raise ConfigError(f"invalid options for strategy {selected.name!r}: {one_line(error)} "
                              f"(its options: {fields})") from None
        log.info("strategy %s (%s) from %s", selected.name, selected.description, selected.distribution)
        return SelectedStrategy(spec=selected, options=validated)

    def _chain(self, spec: StrategySpec) -> list[StrategySpec]:
        chain = [spec]
        while chain[-1].base is not None:
            base = self.strategy(chain[-1].base)
            if base in chain:
                raise ConfigError(f"strategy {spec.name!r} builds on itself through {base.name!r}")
            chain.append(base)
        return chain[::-1]


def _load_entry_points(pm: StrataPluginManager, allow: list[str] | None) -> None:
    """Load each ``strata`` entry point inside a guard: a plugin that fails to import is skipped."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution = entry_point.dist.name if entry_point.dist is not None else entry_point.value
        if allow is not None and entry_point.name not in allow and distribution not in allow:
            continue
        if pm.has_plugin(entry_point.name) or pm.is_blocked(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
            pm.register_plugin(plugin, name=entry_point.name, distribution=distribution)
        except ConfigError:
            raise
        except Exception as error:  # one bad plugin must not stop the engine
            log.warning("skipping plugin %s from %s: %s: %s", entry_point.name, distribution,
                        type(error).__name__, error)


def build_plugin_manager(settings: StrataSettings | None = None) -> StrataPluginManager:
    """A manager with the builtins, the entry-point plugins (unless disabled) and the observers
    switched on in ``settings``; no strategy is selected yet."""
    settings = settings or StrataSettings()
    pm = StrataPluginManager()
    for module_name in (CORE_DEFAULTS_MODULE, *BUILTIN_STRATEGY_MODULES):
        pm.register_plugin(importlib.import_module(module_name), name=module_name, distribution=BUILTIN_DISTRIBUTION)
    if not settings.disable_plugin_autoload:
        _load_entry_points(pm, settings.plugins)
    for module_name, switches in OBSERVER_MODULES.items():
        if any(getattr(settings, switch) for switch in switches):
            pm.register_plugin(importlib.import_module(module_name), name=module_name, distribution=BUILTIN_DISTRIBUTION)
    pm.check_pending()
    return pm
