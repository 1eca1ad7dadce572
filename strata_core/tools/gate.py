"""``strata gate``: the exactness gate (DESIGN invariant 1).

Fixed prompts (``GATE_PROMPTS``: chat, code, math) run greedily under each strategy with the same
set of experts on the devices, and every strategy's tokens are compared with ``single``'s: the
answer is IDENTICAL, or the first differing token and its position.

The same expert set: ``single`` caches the first ``experts`` of the fill order on one device; every
other strategy runs on two device slots with ``--expert-cache experts/2`` each, and its
``StrategySpec.gate_options`` (given a :class:`~strata_core.plugin.GateLayout`) gives the options
under which its caches together hold single's experts. The default fill order is round-robin over
the layers, so ``experts`` is rounded down to a multiple of twice the layer count: each slot then
holds the same number of experts of each of its layers. A strategy that declares no gate options
runs with its defaults, and the gate says so. The gate checks the union of the caches against
single's before it compares tokens, and adaptation is off (``--adapt-swaps 0``).

Across ranks (``--devices cpu,rank1:cpu`` with ``--nnodes``/``--node-rank``/``--dist-init-addr`` or
under torchrun) rank 0 runs the gate: ``single`` alone on its first device, then each strategy over
the ranks, while every other rank serves that strategy's stages in turn (:func:`follow_gate`). A
strategy whose gate placement would make a rank read another's memory (``peer_tier``,
``gpu1_experts``) is refused on every rank before anything loads.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.plugin import GateLayout, StrategySpec
from strata_core.plugin.manager import build_plugin_manager
from strata_core.remote.launch import Launch
from strata_core.runtime.devices import resolve_slots, split_rank

__all__ = ["GATE_PROMPTS", "GATE_SLOTS", "REFERENCE", "GateResult", "Rounds", "follow_gate", "gate_layout", "gate_settings",
           "greedy_tokens", "run_gate"]

#: The strategy every other one is compared with, and the device slots the others run on.
REFERENCE = "single"
GATE_SLOTS = 2

#: The gate's prompts by name (plain text; ``chat`` goes through the model's chat template).
GATE_PROMPTS = {
    "chat": "Tell me about the city of Jerusalem and the people who lived there.",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "math": "Question: what is 17 times 23? Answer step by step.\nAnswer:",
}


@dataclass(frozen=True)
class GateResult:
    """One strategy against single: ``first`` is None when IDENTICAL, else (prompt, position, got, want)."""

    strategy: str
    first: tuple[str, int, int, int] | None
    expert_set: bool = True  # the strategy's caches held single's experts

    def line(self) -> str:
        """The gate's line for this strategy."""
        if not self.expert_set:
            return f"{self.strategy:<14} DIFFERENT EXPERT SET (not comparable)"
        if self.first is None:
            return f"{self.strategy:<14} IDENTICAL"
        prompt, position, got, want = self.first
        return f"{self.strategy:<14} DIFFERS: prompt {prompt}, token {position}: {got} (single: {want})"


def gate_layout(experts: int | None, n_layers: int, n_experts: int) -> GateLayout:
    """The gate's layout for ``experts`` cached by single (None: half of all), rounded down to a
    multiple of ``GATE_SLOTS`` x ``n_layers``; more than the model has is a :class:`ConfigError`."""
    total = n_layers * n_experts
    if experts is not None and experts > total:
        raise ConfigError(f"gate: --experts {experts} is more than the model has ({n_layers} layers x "
                          f"{n_experts} = {total})")
    wanted = total // 2 if experts is None else experts
    return GateLayout(slots=GATE_SLOTS, experts_per_slot=wanted // (GATE_SLOTS * n_layers) * n_layers,
                      n_layers=n_layers, n_experts=n_experts)


def gate_settings(settings: StrataSettings, strategy: StrategySpec, layout: GateLayout) -> StrataSettings:
    """``settings`` for ``strategy`` in the gate: single on the first device with all of ``layout``'s
    experts cached, any other on ``layout.slots`` device slots with ``experts_per_slot`` each and the
    options its spec's ``gate_options`` gives (none declared: its defaults)."""
    slots = layout.slots
    devices = list(settings.devices[:slots]) if len(settings.devices) >= slots else [settings.devices[0]] * slots
    reference = strategy.name == REFERENCE
    options = {} if reference or strategy.gate_options is None else dict(strategy.gate_options(layout))
    values = settings.model_dump() | {
        "strategy": strategy.name, "strategy_options": options, "adapt_swaps": 0,
        "expert_cache": slots * layout.experts_per_slot if reference else layout.experts_per_slot,
        "expert_cache_gib": None, "expert_profile": None, "devices": devices[:1] if reference else devices}
    return StrataSettings(**values)


def greedy_tokens(engine: Any, ids: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` (argmax, lowest id on ties; no stop at end of sequence)."""
    session = engine.new_session()
    try:
        logits = engine.prefill(session, ids)
        out: list[int] = []
        for _ in range(n):
            out.append(int(torch.argmax(logits.reshape(-1))))
            if len(out) < n:
                logits = engine.decode_window([(session, out[-1])])[0]
        return out
    finally:
        engine.release_session(session)


def _prompt_ids(engine: Any, name: str) -> list[int]:
    text = GATE_PROMPTS[name]
    if engine.tokenizer is None:
        raise ConfigError(f"{engine.settings.model} has no tokenizer: the gate's prompts are text")
    if name == "chat":
        text = engine.chat.render([{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def _strategies(settings: StrataSettings, names: Sequence[str] | None) -> list[StrategySpec]:
    """The specs of ``names`` (None: every installed strategy), the reference first."""
    plugins = build_plugin_manager(settings)
    chosen = dict.fromkeys(plugins.strategy(name).name for name in (plugins.strategies if names is None else names))
    return [plugins.strategy(name) for name in (REFERENCE, *(name for name in chosen if name != REFERENCE))]


def _plan(settings: StrataSettings, names: Sequence[str] | None, experts: int | None, rank: int
          ) -> tuple[GateLayout, list[StrategySpec]]:
    """The gate's layout and strategies (the reference first); across ranks, ConfigError naming every
    strategy whose gate placement cannot run there."""
    from strata_core.engine_load import plan_placement

    spec = load_model_spec(GGUFFile.open(settings.model))
    layout = gate_layout(experts, spec.n_layers, spec.n_experts)
    specs = _strategies(settings, names)
    refused = []
    for strategy in specs[1:]:
        values = gate_settings(settings, strategy, layout)
        if not any(split_rank(name)[0] for name in values.devices):
            continue
        plugins = build_plugin_manager(values)
        try:
            plan_placement(plugins, plugins.select_strategy(strategy.name, values.strategy_options), values,
                           resolve_slots(values.devices, rank), spec)
        except ConfigError as error:
            refused.append(f"{strategy.name} ({error})")
    if refused:
        raise ConfigError(f"gate: across ranks no rank reads another's memory, so these strategies cannot run: "
                          f"{'; '.join(refused)}; name the others with --strategies")
    return layout, specs


def _experts_line(layout: GateLayout, experts: int | None, prompts: Sequence[str], tokens: int) -> str:
    held = layout.slots * layout.experts_per_slot
    rounded = f" (--experts {experts} rounded down to a multiple of {layout.slots} x {layout.n_layers} layers)" \
        if experts is not None and experts != held else ""
    return (f"gate: {len(prompts)} prompt(s) x {tokens} tokens, greedy; {held} of {layout.n_layers * layout.n_experts} "
            f"experts ({layout.n_layers} layers x {layout.n_experts}) on the devices of every strategy: {REFERENCE}'s "
            f"on one slot, {layout.experts_per_slot} per slot on {layout.slots} slots for the others{rounded}")


def run_gate(settings: StrataSettings, strategies: Sequence[str] | None, prompts: Sequence[str], tokens: int,
             experts: int | None, load: Callable[[StrataSettings], Any], say: Callable[[str], None] = print
             ) -> list[GateResult]:
    """Run the gate; ``load(settings) -> Engine``. ``strategies``: the names to compare with single
    (None: every installed strategy). ``experts``: single's cache (None: half of the experts).
    Returns one result per strategy other than single, in order."""
    unknown = [p for p in prompts if p not in GATE_PROMPTS]
    if unknown:
        raise ConfigError(f"gate: unknown prompt(s) {', '.join(unknown)}; the gate has {', '.join(GATE_PROMPTS)}")
    layout, specs = _plan(settings, strategies, experts, rank=0)
    say(_experts_line(layout, experts, prompts, tokens))
    want: dict[str, list[int]] = {}
    plan: set[tuple[int, int]] = set()
    results = []
    for strategy in specs:
        if strategy.name != REFERENCE and strategy.gate_options is None:
            say(f"{strategy.name:<14} declares no gate options: its default options, {layout.experts_per_slot} "
                f"experts per slot; compared only if its caches hold {REFERENCE}'s experts")
        engine = None
        try:
            engine = load(gate_settings(settings, strategy, layout))
            held = engine.resident_experts()
            got = {name: greedy_tokens(engine, _prompt_ids(engine, name), tokens) for name in prompts}
        finally:
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if strategy.name == REFERENCE:
            want, plan = got, held
            say(f"{REFERENCE:<14} reference ({', '.join(settings.devices[:1])})")
            continue
        first = next(((name, i, a, b) for name in prompts for i, (a, b) in enumerate(zip(got[name], want[name]))
                      if a != b), None)
        result = GateResult(strategy.name, first, held == plan)
        say(result.line())
        results.append(result)
    return results


class Rounds:
    """Where the ranks meet for each strategy of the gate: one TCP store at the launch's address, a
    prefix of its own per strategy (a process group made anew must not meet the last one's keys)."""

    def __init__(self, launch: Launch) -> None:
        from strata_core.remote.group import LOAD_TIMEOUT_S

        host, port = launch.address.rsplit(":", 1)
        self.launch = launch
        self._store = dist.TCPStore(host, int(port), launch.world, launch.rank == 0,
                                    timedelta(seconds=LOAD_TIMEOUT_S))
        self._round = 0

    def next(self) -> dist.Store:
        """The store of the next strategy's round."""
        self._round += 1
        return dist.PrefixStore(f"strata-gate-{self._round}/", self._store)

    def load(self, settings: StrataSettings) -> Any:
        """Rank 0: the engine of ``settings``, over the ranks where its devices name other ranks'."""
        from strata_core.engine import Engine
        from strata_core.remote import Cluster

        if not any(split_rank(name)[0] for name in settings.devices):
            return Engine.from_settings(settings)
        return Engine.from_settings(settings, cluster=Cluster.join(settings, self.launch, self.next()))


def follow_gate(settings: StrataSettings, strategies: Sequence[str] | None, experts: int | None, rounds: Rounds
                ) -> None:
    """Another rank's part of the gate rank 0 runs (:func:`run_gate` with the same arguments and
    ``rounds.load``): serve the stages of each strategy compared with single, in the same order."""
    from strata_core.remote import serve_stages

    layout, specs = _plan(settings, strategies, experts, rounds.launch.rank)
    for strategy in specs[1:]:
        serve_stages(gate_settings(settings, strategy, layout), rounds.launch, rounds.next())
