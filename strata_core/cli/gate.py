"""``strata gate``: greedy outputs of fixed prompts under each strategy, compared with ``single``'s."""

from __future__ import annotations

import sys

from pydantic import Field

from strata_core.cli.settings import ENGINE, RANKS, settings_with


class GateCommand(settings_with(ENGINE, RANKS)):  # type: ignore[misc]
    """Run the gate's prompts greedily under each strategy with the same experts on the devices;
    print IDENTICAL or the first differing token per strategy (exit 1 on a difference). Across ranks
    (--devices cpu,rank1:cpu with --nnodes N --node-rank R --dist-init-addr HOST:PORT, or torchrun)
    rank 0 prints the gate and the others serve each strategy's stages."""

    strategies: str | None = Field(None, description="strategies compared with single (comma-separated; "
                                   "default: every installed strategy)")
    prompts: str = Field("chat,code,math", description="gate prompts: chat, code, math")
    tokens: int = Field(32, ge=1, description="greedy tokens per prompt")
    experts: int | None = Field(None, ge=0, description="experts single caches, split over two slots for the "
                                "others (default: half of all; rounded to a multiple of 2 x layers)")

    def cli_cmd(self) -> None:
        """Load each strategy in turn, generate, compare; exit status 1 when one differs."""
        from strata_core.engine import Engine
        from strata_core.remote import launch_of
        from strata_core.tools.gate import Rounds, follow_gate, run_gate

        def split(text: str) -> list[str]:
            return [part.strip() for part in text.split(",") if part.strip()]

        strategies = None if self.strategies is None else split(self.strategies)
        settings = self.strata_settings()
        launch = launch_of(settings)
        rounds = None if launch is None else Rounds(launch)
        if rounds is not None and rounds.launch.rank != 0:
            follow_gate(settings, strategies, self.experts, rounds)
            return
        results = run_gate(settings, strategies, split(self.prompts), self.tokens, self.experts,
                           Engine.from_settings if rounds is None else rounds.load)
        if any(r.first is not None or not r.expert_set for r in results):
            sys.exit(1)
        print("gate: IDENTICAL")
