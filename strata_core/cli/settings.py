"""Each command's share of :class:`~strata_core.config.StrataSettings`.

A command declares the groups of settings it uses (``ENGINE``, ``SERVER``, ``RANKS``, ``PLUGINS``) and gets a
settings class with exactly those fields: their flags in its ``--help``, their ``STRATA_*``
variables and TOML keys, with StrataSettings' validation. ``strata plugins --help`` therefore lists
no ``--api-key``, and a TOML key that one command does not use is simply not read by it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import create_model, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from strata_core.config import StrataSettings

__all__ = ["ENGINE", "PLUGINS", "RANKS", "SERVER", "CommandSettings", "settings_with"]

PLUGINS = ("plugins", "disable_plugin_autoload")
SERVER = ("host", "port", "parallel", "step_tokens", "max_queue", "conv_cache", "conv_cache_gib", "api_key",
          "model_alias", "max_body_mib", "allowed_hosts", "threads", "header_timeout", "body_timeout",
          "max_connections", "shutdown_grace", "cors", "template_timeout", "template_max_mib", "webui",
          "strict_requests", "strict_model", "n_predict", "seed", "reasoning", "spec", "spec_tokens",
          "spec_min_p", "grammar_file", "json_schema")
RANKS = ("nnodes", "node_rank", "dist_init_addr", "dist_timeout")
ENGINE = tuple(name for name in StrataSettings.model_fields if name not in SERVER and name not in RANKS)


class CommandSettings(BaseSettings):
    """Base of the command classes: StrataSettings' sources (flags, ``STRATA_*``, the TOML file)."""

    model_config = StrataSettings.model_config

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """StrataSettings' sources, in its order."""
        return StrataSettings.settings_customise_sources(settings_cls, init_settings, env_settings, dotenv_settings,
                                                         file_secret_settings)

    def strata_settings(self, **overrides: Any) -> StrataSettings:
        """The StrataSettings the engine and the server take: this command's values (defaults for the
        settings it does not use) with ``overrides``."""
        values = {name: getattr(self, name) for name in StrataSettings.model_fields if name in type(self).model_fields}
        return StrataSettings(**(values | overrides))


def _validators(fields: set[str]) -> dict[str, Any]:
    """StrataSettings' field validators that apply to ``fields``."""
    out = {}
    for name, decorator in StrataSettings.__pydantic_decorators__.field_validators.items():
        used = [f for f in decorator.info.fields if f in fields]
        if used:
            # the function, not the method bound to StrataSettings: pydantic binds it to the new class
            out[name] = field_validator(*used, mode=decorator.info.mode)(decorator.func.__func__)
    return out


def settings_with(*groups: Iterable[str]) -> type[CommandSettings]:
    """A CommandSettings subclass holding the StrataSettings fields of ``groups``."""
    names = [name for group in groups for name in group]
    fields = {name: (StrataSettings.model_fields[name].annotation, StrataSettings.model_fields[name])
              for name in names}
    return create_model("Settings", __base__=CommandSettings, __validators__=_validators(set(names)),
                        **fields)  # type: ignore[call-overload]
