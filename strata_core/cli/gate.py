"""``strata gate``: greedy outputs of fixed prompts under each strategy, compared with ``single``'s."""

from __future__ import annotations

import sys

from pydantic import Field

from strata_core.cli.settings import ENGINE, settings_with


class GateCommand(settings_with(ENGINE)):  # type: ignore[misc]
    """Run the gate's prompts greedily under each strategy with the same experts on the devices;
    print IDENTICAL or the first differing token per strategy (exit 1 on a difference)."""

    strategies: str | None = Field(None, description="strategies compared with single (comma-separated; "
                                   "default: every installed strategy)")
    prompts: str = Field("chat,code,math", description="gate prompts: chat, code, math")
    tokens: int = Field(32, ge=1, description="greedy tokens per prompt")
    experts: int | None = Field(None, ge=0, description="experts single caches, split over two slots for the "
                                "others (default: half of all; rounded to a multiple of 2 x layers)")

    def cli_cmd(self) -> None:
        """Load each strategy in turn, generate, compare; exit status 1 when one differs."""
        from strata_core.engine import Engine
        from strata_core.tools.gate import run_gate

        def split(text: str) -> list[str]:
            return [part.strip() for part in text.split(",") if part.strip()]

        strategies = None if self.strategies is None else split(self.strategies)
        results = run_gate(self.strata_settings(), strategies, split(self.prompts), self.tokens,
                           self.experts, Engine.from_settings)
        if any(r.first is not None or not r.expert_set for r in results):
            sys.exit(1)
        print("gate: IDENTICAL")
