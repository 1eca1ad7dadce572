"""The ``strata`` command: subcommands parsed by pydantic-settings' own CLI support.

Every subcommand holds its share of :class:`~strata_core.config.StrataSettings` (cli/settings.py),
so each of its options is also a ``STRATA_*`` variable and a key of the TOML file (``--config FILE``
or ``STRATA_CONFIG``). Every user error (a StrataError, an invalid setting, an unknown flag) is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import (
    CliApp, CliImplicitFlag, CliSettingsSource, CliSubCommand, SettingsError, TomlConfigSettingsSource, get_subcommand,
)  # fmt: skip

from strata_core.cli.bench import BenchCommand
from strata_core.cli.chat import ChatCommand
from strata_core.cli.gate import GateCommand
from strata_core.cli.generate import GenerateCommand
from strata_core.cli.help import SHORTCUTS, CommandParser, HelpFormatter, HelpLayout, subcommand_model
from strata_core.cli.info import InfoCommand
from strata_core.cli.make_synthetic import MakeSyntheticCommand
from strata_core.cli.plugins_cmd import PluginsCommand
from strata_core.cli.profile import ProfileCommand
from strata_core.cli.serve import ServeCommand
from strata_core.config import CONFIG_FILE_ENV, StrataSettings, config_file_path
from strata_core.errors import ConfigError, StrataError, one_line


class Strata(BaseModel):
    """Strata: run Mixture-of-Experts GGUF models larger than your GPUs."""

    model_config = ConfigDict(extra="forbid")

    info: CliSubCommand[InfoCommand] = Field(description="architecture, block types, sizes, VRAM fit")
    generate: CliSubCommand[GenerateCommand] = Field(description="complete a prompt")
    chat: CliSubCommand[ChatCommand] = Field(description="talk with the model, turn by turn")
    plugins: CliSubCommand[PluginsCommand] = Field(description="the installed strategies")
    serve: CliSubCommand[ServeCommand] = Field(description="OpenAI-compatible HTTP server")
    profile: CliSubCommand[ProfileCommand] = Field(description="record expert usage over prompts")
    bench: CliSubCommand[BenchCommand] = Field(description="prefill and decode speed")
    gate: CliSubCommand[GateCommand] = Field(description="exactness gate: greedy output of each strategy vs single")
    make_synthetic: CliSubCommand[MakeSyntheticCommand] = Field(description="write a random model of real shapes")
    version: CliImplicitFlag[bool] = Field(False, description="print the version and exit")

    def cli_cmd(self) -> None:
        """Run the chosen subcommand (or print the version)."""
        if self.version:
            print(f"strata {importlib.metadata.version('strata')}")
            return
        if get_subcommand(self, is_required=False) is None:
            raise ConfigError(f"a command is needed: {', '.join(command_names())} (strata COMMAND --help)")
        CliApp.run_subcommand(self)


def command_names() -> list[str]:
    """The subcommands as they are typed (``make-synthetic``)."""
    return [name.replace("_", "-") for name, field in Strata.model_fields.items() if name != "version"]


def _check_config_keys() -> None:
    """Every key of the settings file must be a setting of some command (catches typos)."""
    path = config_file_path()
    if path is None:
        return
    try:
        keys = set(TomlConfigSettingsSource(StrataSettings, toml_file=path).toml_data)
    except (OSError, ValueError) as error:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"settings file {path}: {error}") from None
    known = set(StrataSettings.model_fields) | _setting_names(Strata)
    if unknown := sorted(keys - known):
        raise ConfigError(f"settings file {path}: unknown key(s) {', '.join(unknown)}")


def _setting_names(command: type[BaseModel]) -> set[str]:
    """The settings of every subcommand under ``command``, nested ones (``bench serve``) too."""
    names: set[str] = set()
    for field in command.model_fields.values():
        if (sub := subcommand_model(field)) is not None:
            names |= {name for name, f in sub.model_fields.items() if subcommand_model(f) is None} | _setting_names(sub)
    return names


def _expand_args(argv: list[str]) -> list[str]:
    """``--config FILE`` anywhere on the line sets ``STRATA_CONFIG`` (read before parsing)."""
    out = []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            os.environ[CONFIG_FILE_ENV] = next(it, "")
        elif arg.startswith("--config="):
            os.environ[CONFIG_FILE_ENV] = arg.split("=", 1)[1]
        else:
            out.append(arg)
    return out


def _source() -> CliSettingsSource:
    """The CLI source of ``Strata``: grouped one-line help (cli/help.py), short flags, one-line errors."""
    layout = HelpLayout(Strata)
    parser = CommandParser(prog="strata", description=Strata.__doc__,
                           formatter_class=HelpFormatter, allow_abbrev=False)
    return CliSettingsSource(Strata, cli_kebab_case=True, cli_implicit_flags=True, cli_avoid_json=True,
                             cli_hide_none_type=True, cli_shortcuts=SHORTCUTS, root_parser=parser,
                             formatter_class=HelpFormatter, add_argument_method=layout.add_argument,
                             add_parser_method=layout.add_parser)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``strata`` console script: 0 on success, 2 on a user error (one line)."""
    # force: a handler an earlier main() in this process left on a stderr since closed (tests capture it
    # per test) would make every later record a "Logging error"
    logging.basicConfig(level=os.environ.get("STRATA_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    args = _expand_args(list(sys.argv[1:] if argv is None else argv))
    try:
        _check_config_keys()
        CliApp.run(Strata, cli_args=args, cli_settings_source=_source())
    except StrataError as error:
        print(f"strata: error: {error}", file=sys.stderr)
        return 2
    except (SettingsError, ValidationError) as error:
        print(f"strata: error: invalid settings: {one_line(error, flags=True)}", file=sys.stderr)
        return 2
    return 0


