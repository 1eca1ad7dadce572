"""The ``strata`` command: subcommands parsed by pydantic-settings' own CLI support.

Every subcommand is a :class:`~strata_core.config.StrataSettings` subclass, so each option is also
a ``STRATA_*`` variable and a key of the TOML file (``--config FILE`` or ``STRATA_CONFIG``).
A :class:`~strata_core.errors.StrataError` is printed without a traceback and exits with status 2.
"""

from __future__ import annotations

import logging
import os
import sys

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import CliApp, CliSubCommand, SettingsError

from strata_core.cli.bench import BenchCommand
from strata_core.cli.generate import GenerateCommand
from strata_core.cli.info import InfoCommand
from strata_core.cli.make_synthetic import MakeSyntheticCommand
from strata_core.cli.plugins_cmd import PluginsCommand
from strata_core.cli.profile import ProfileCommand
from strata_core.cli.serve import ServeCommand
from strata_core.config import CONFIG_FILE_ENV
from strata_core.errors import StrataError


class Strata(BaseModel):
    """Strata: run Mixture-of-Experts GGUF models larger than your GPUs."""

    model_config = ConfigDict(extra="forbid")

    info: CliSubCommand[InfoCommand] = Field(description="architecture, block types, sizes, VRAM fit")
    generate: CliSubCommand[GenerateCommand] = Field(description="complete a prompt")
    plugins: CliSubCommand[PluginsCommand] = Field(description="the installed strategies")
    serve: CliSubCommand[ServeCommand] = Field(description="OpenAI-compatible HTTP server")
    profile: CliSubCommand[ProfileCommand] = Field(description="record expert usage over prompts")
    bench: CliSubCommand[BenchCommand] = Field(description="prefill and decode speed")
    make_synthetic: CliSubCommand[MakeSyntheticCommand] = Field(description="write a random model of real shapes")

    def cli_cmd(self) -> None:
        """Run the chosen subcommand."""
        CliApp.run_subcommand(self)


def _take_config_flag(argv: list[str]) -> list[str]:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``strata`` console script."""
    logging.basicConfig(level=os.environ.get("STRATA_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = _take_config_flag(list(sys.argv[1:] if argv is None else argv))
    try:
        CliApp.run(Strata, cli_args=args, cli_exit_on_error=True)
    except StrataError as error:
        print(f"strata: error: {error}", file=sys.stderr)
        return 2
    except (SettingsError, ValidationError) as error:
        print(f"strata: error: invalid settings: {error}", file=sys.stderr)
        return 2
    return 0
