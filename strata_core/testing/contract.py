"""The plugin contract enforced in tests: a phase hook that reads outside ``PhaseContext`` fails.

``with strict_context(engine):`` makes every phase hook of ``engine`` receive, as ``ctx``, a view of
its runner that answers only the members of :class:`~strata_core.plugin.context.PhaseContext`
(``CONTEXT_MEMBERS``); reading any other attribute, or setting one, raises
:class:`ContractViolation` naming it. Run a strategy's prompts and decode windows inside it to show
that the strategy keeps to the contract.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from strata_core.engine import Engine
from strata_core.plugin.context import CONTEXT_MEMBERS

__all__ = ["ContractViolation", "StrictContext", "strict_context"]


class ContractViolation(AssertionError):
    """A plugin touched an attribute of ``ctx`` that the plugin contract does not offer."""


class StrictContext:
    """A view of ``target`` with only the ``PhaseContext`` members; ``read`` records the names read."""

    def __init__(self, target: object) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        if name not in CONTEXT_MEMBERS:
            raise ContractViolation(f"a plugin read ctx.{name}, which PhaseContext does not offer "
                                    f"(it offers: {', '.join(sorted(CONTEXT_MEMBERS))})")
        self.read.add(name)
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise ContractViolation(f"a plugin set ctx.{name}; PhaseContext is read-only for plugins")


@contextmanager
def strict_context(engine: Engine) -> Iterator[StrictContext]:
    """While the block runs, ``engine``'s phase hooks receive a :class:`StrictContext` of its runner."""
    runner = engine.runner
    view = StrictContext(runner)
    runner.context = view  # type: ignore[assignment]
    try:
        yield view
    finally:
        runner.context = runner
