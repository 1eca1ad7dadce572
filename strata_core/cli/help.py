"""The ``strata`` help, laid out like llama.cpp's: options in groups, plain metavars, one line an option.

pydantic-settings builds the argparse parsers; :class:`HelpLayout` supplies its ``add_argument`` and
``add_parser`` hooks, which put each option in its group (``GROUPS``), give it a plain metavar
(``N``, ``GiB``, ``PATH``) and a help text of its field's description and default.
:class:`HelpFormatter` writes ``--help`` with one line an option (a ``BRIEF`` option: its flag only)
and ``--help-all`` with every description in full. :class:`CommandParser` says every parse error on
one line naming the command that met it.
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from strata_core.cli.settings import SERVER

__all__ = ["BRIEF", "GROUPS", "SHORTCUTS", "CommandParser", "HelpFormatter", "HelpLayout", "subcommand_model"]

#: the settings of each help group, in the order the groups are shown; a command's other options
#: are in its "options" group
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "max_context", "kv_block", "kv_pool_tokens", "kv_type", "prefill_chunk"),
    "placement": ("strategy", "devices", "strategy_options", "nnodes", "node_rank", "dist_init_addr", "dist_timeout"),
    "experts": ("expert_cache", "expert_cache_gib", "vram_budget_gib", "arena", "expert_profile", "pin_limit_gib",
                "reserve_mib", "pcie_frac", "adapt_swaps", "expert_cache_fill_all"),
    "sampling": ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"),
    "server": SERVER,
    # the kernel choices (CUDA) are there to compare each with the torch form it replaces
    "debug": ("cuda_graphs", "overlap_windows", "batch_invariant", "dense_q8", "fused_norms", "device_sdpa", "mla_kernel",
              "deltanet_chunked", "fused_expert_ffn", "miss_read", "moe_config", "prefill_timing", "decode_timing",
              "dbg_nan", "dbg_handoff", "plugins", "disable_plugin_autoload"),
}

#: options ``--help`` lists by flag only, after their group's others (``--help-all`` describes them)
BRIEF = frozenset(GROUPS["debug"]) | {
    "kv_block", "kv_pool_tokens", "kv_type", "prefill_chunk", "pin_limit_gib", "reserve_mib", "vram_budget_gib",
    "pcie_frac", "adapt_swaps",
    "expert_cache_fill_all", "threads", "max_queue", "conv_cache", "header_timeout", "body_timeout", "max_connections", "shutdown_grace",
    "template_timeout", "template_max_mib", "max_body_mib", "allowed_hosts", "conv_cache_gib", "step_tokens",
    "spec", "spec_tokens", "spec_min_p", "webui", "strict_requests", "strict_model", "n_predict", "cors", "grammar_file", "json_schema",
    "seed", "reasoning", "nnodes", "node_rank", "dist_init_addr", "dist_timeout",
}

#: the short flags llama.cpp users type (cli_shortcuts: kebab-case flag -> its other names)
SHORTCUTS = {"model": "m", "max-context": ["c", "ctx-size"], "max-tokens": "n", "prompt": "p", "file": "f"}

#: metavars by field name, where the type's (``N``, ``X``, ``PATH``) says too little
_METAVARS = {"host": "ADDR", "api_key": "KEY", "model_alias": "NAME", "strategy": "NAME", "strategy_options": "K=V",
             "moe_config": "K=V", "file": "PATH",
             "dtype": "TYPE", "kv_type": "TYPE", "dist_init_addr": "HOST:PORT",
             "spec": "MODE"}  # --spec: off, ngram or mtp (its description)
_TYPE_METAVARS: dict[Any, str] = {int: "N", float: "X", str: "TEXT", Path: "PATH"}


def subcommand_model(field: FieldInfo) -> type[BaseModel] | None:
    """The command class of a subcommand field (``CliSubCommand[X]``: an optional X), else None."""
    return next((arg for arg in typing.get_args(field.annotation) if isinstance(arg, type)
                 and issubclass(arg, BaseModel)), None)


def _metavar(name: str, annotation: Any) -> str:
    """A plain metavar: ``N``, ``X``, ``GiB``, ``PATH``, ``LIST``, ``{a,b}`` for a few choices."""
    if name in _METAVARS:
        return _METAVARS[name]
    for suffix, unit in (("_gib", "GiB"), ("_mib", "MiB"), ("timeout", "SEC"), ("grace", "SEC")):
        if name.endswith(suffix):
            return unit
    kind = typing.get_origin(annotation)
    if kind in (typing.Union, types.UnionType):  # int | Literal["auto"] | None -> {N,auto}
        parts = [_metavar(name, arg).strip("{}") for arg in typing.get_args(annotation) if arg is not type(None)]
        return parts[0] if len(parts) == 1 else "{" + ",".join(parts) + "}"
    if kind is Literal:
        return "{" + ",".join(map(str, typing.get_args(annotation))) + "}"
    if kind is typing.Annotated:
        return _metavar(name, typing.get_args(annotation)[0])
    if kind in (list, tuple, set):
        return "LIST"
    if kind is dict:
        return "K=V"
    return _TYPE_METAVARS.get(annotation, "X")


def _default(field: FieldInfo) -> str | None:
    """The default as help shows it, or None where it says nothing (None, an empty list, a switch)."""
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if value is None or isinstance(value, bool) or value in ([], {}) or "default:" in (field.description or ""):
        return None
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return None if len(text) > 24 else f"default: {text}"


def _first_clause(text: str) -> str:
    """``text`` up to its first parenthesis or semicolon: the part that fits on a line."""
    cut = min((i for i in (text.find(" ("), text.find("; ")) if i > 0), default=len(text))
    return text[:cut]


def _is_short(flag: str) -> bool:
    return len(flag) == 2 and flag.startswith("-")


class HelpLayout:
    """The add_argument / add_parser hooks of CliSettingsSource that lay the help out (see the module doc)."""

    def __init__(self, root: type[BaseModel]) -> None:
        self._root = root
        self._groups: dict[tuple[int, str], Any] = {}

    def _field(self, dest: str) -> tuple[str, FieldInfo] | None:
        """The field behind an option's ``dest`` (``generate.max_tokens``, ``bench.json``), if any."""
        model: type[BaseModel] | None = self._root
        *commands, last = dest.split(".")
        for name in commands:
            model = subcommand_model(model.model_fields[name]) if model and name in model.model_fields else None
        if model is None:
            return None
        return next(((name, field) for name, field in model.model_fields.items() if last in (name, field.alias)), None)

    def add_parser(self, subparsers: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A command's parser, with its groups in ``GROUPS`` order and ``--help-all``."""
        parser = subparsers.add_parser(name, **kwargs)
        for title in GROUPS:
            self._groups[id(parser), title] = parser.add_argument_group(title)
        help_action = next(a for a in parser._actions if isinstance(a, argparse._HelpAction))
        help_action.help = "this help (--help-all: every option in full)"
        parser.add_argument("--help-all", action=_HelpAllAction, help=argparse.SUPPRESS)
        return parser

    def add_argument(self, context: Any, *names: str, **kwargs: Any) -> argparse.Action:
        """Add an option to its group, with a plain metavar and its field's help."""
        found = self._field(kwargs.get("dest", ""))
        if found is None or kwargs.get("help") == argparse.SUPPRESS:
            return context.add_argument(*names, **kwargs)
        name, field = found
        names = tuple(sorted(names, key=lambda flag: not _is_short(flag)))  # -m, --model: usage shows -m
        # a field of two groups (seed: generate's sampling option, serve's server default) goes to the
        # one the command has other fields of
        command = kwargs.get("dest", "").rpartition(".")[0]
        groups = [title for title, fields in GROUPS.items() if name in fields]
        group = next((title for title in groups if any(self._field(f"{command}.{other}".lstrip("."))
                                                       for other in GROUPS[title] if other != name)),
                     groups[0] if groups else None)
        if group is not None and isinstance(context, argparse.ArgumentParser):
            context = self._groups.get((id(context), group), context)
        if "metavar" in kwargs:
            kwargs["metavar"] = _metavar(name, field.annotation)
        description = field.description or ""
        default = f" ({_default(field)})" if _default(field) else ""
        kwargs["help"] = description + default
        action = context.add_argument(*names, **kwargs)
        action.brief = name in BRIEF  # type: ignore[attr-defined]
        action.short_help = _first_clause(description) + default  # type: ignore[attr-defined]
        if isinstance(action, argparse.BooleanOptionalAction):
            # the one flag that changes the default (both are accepted)
            on = field.default is True
            action.shown = action.option_strings[1 if on else 0]  # type: ignore[attr-defined]
            if on:
                action.help = f"turns off: {action.help}"
                action.short_help = f"turns off: {action.short_help}"  # type: ignore[attr-defined]
        return action


class _HelpAllAction(argparse.Action):
    """``--help-all``: the help with every option described in full."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        parser.formatter_class = FullHelpFormatter
        parser.print_help()
        parser.exit()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help``: the usage shows the positionals and short flags, the description its first
    paragraph, each option one line; a brief option is listed by its flag after the others of its group."""

    full = False

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=28, width=min(shutil.get_terminal_size().columns, 120) - 2)

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        shown = [a for a in actions if not a.option_strings
                 or any(map(_is_short, a.option_strings)) and not isinstance(a, argparse._HelpAction)]
        text = super()._format_usage(usage, shown, [], prefix)
        return text.rstrip("\n") + (" [options]\n\n" if len(shown) < len(actions) else "\n\n")

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str) -> Any:
        if isinstance(action, argparse._SubParsersAction):
            return lambda size: ("COMMAND",) * size if isinstance(size, int) else "COMMAND"
        return super()._metavar_formatter(action, default_metavar)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if hasattr(action, "shown"):
            return action.shown
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        flags = action.option_strings if self.full else action.option_strings[:2]
        return f"{', '.join(flags)} {self._metavar_formatter(action, action.dest.upper())(1)[0]}"

    def add_arguments(self, actions: Any) -> None:
        if self.full:
            return super().add_arguments(actions)
        brief = [a for a in actions if getattr(a, "brief", False) and a.help != argparse.SUPPRESS]
        super().add_arguments([a for a in actions if a not in brief])
        if brief:
            # a no-break space holds each flag to its metavar while wrapping
            flags = " ".join(self._format_action_invocation(a).replace(" ", "\xa0") for a in brief)
            lines = textwrap.wrap(flags, self._width - self._current_indent, break_on_hyphens=False)
            self.add_text("\n".join(lines).replace("\xa0", " "))

    def add_text(self, text: str | None) -> None:
        if text and self._current_section is self._root_section:  # the command's description
            text = inspect.cleandoc(text)
            text = text if self.full else text.split("\n\n")[0]
        super().add_text(text)

    def _expand_help(self, action: argparse.Action) -> str:
        return action.help if self.full or not hasattr(action, "short_help") else action.short_help  # type: ignore[return-value]

    def _split_lines(self, text: str, width: int) -> list[str]:
        if self.full:
            return super()._split_lines(text, width)
        return [text if len(text) <= width else text[:width - 1] + "…"]


class FullHelpFormatter(HelpFormatter):
    """``--help-all``: every option on its own lines with its whole description."""

    full = True


class CommandParser(argparse.ArgumentParser):
    """A parser whose errors (an unknown flag, a bad value) are one line naming its command, exit 2."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """Parse, failing on an argument this command does not know (not its parent)."""
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra

    def error(self, message: str) -> NoReturn:
        """Say ``message`` on one line with the command's name, exit 2."""
        self.exit(2, f"strata: error: {message} (see `{self.prog} --help`)\n")
