"""``strata plugins``: the strategies installed, with descriptions and where they came from."""

from __future__ import annotations

from strata_core.cli.settings import PLUGINS, settings_with
from strata_core.config import StrataSettings
from strata_core.plugin.manager import build_plugin_manager


def list_strategies(settings: StrataSettings) -> str:
    """One line per installed strategy: name, base, distribution, description."""
    pm = build_plugin_manager(settings)
    lines = []
    for name in sorted(pm.strategies):
        spec = pm.strategies[name]
        base = f" (builds on {spec.base})" if spec.base else ""
        lines.append(f"{name:<14} {spec.description}{base}  [{spec.distribution}]")
    return "\n".join(lines)


class PluginsCommand(settings_with(PLUGINS)):
    """List the installed strategies and where they came from."""

    def cli_cmd(self) -> None:
        """Print the list."""
        print(list_strategies(self.strata_settings()))
