"""``strata gate``: the exactness gate (DESIGN invariant 1, seeds #110 / #229).

Fixed prompts (``GATE_PROMPTS``: chat, code, math) run greedily under each strategy with the same
set of experts on the devices, and every strategy's tokens are compared with ``single``'s: the
answer is IDENTICAL, or the first differing token and its position.

The same expert set: ``single`` caches the first ``experts`` of the fill order on one device. Every
strategy on two device slots gets half of that per slot (``--expert-cache experts/2``; ``peer_tier``'s
``peer_slots`` and ``gpu1_experts``' ``slots_device1`` the other half); ``layer_split`` and
``prefill_main`` cut the layers in two halves, and since the default fill order is round-robin over
the layers, each stage then holds exactly single's experts of its layers (``experts`` is rounded
down to a multiple of twice the layer count for that). The gate checks the union of the caches
against single's before it generates, and adaptation is off (``--adapt-swaps 0``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec

__all__ = ["GATE_PROMPTS", "GateResult", "gate_settings", "greedy_tokens", "run_gate"]

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


def gate_settings(settings: StrataSettings, strategy: str, experts: int, n_layers: int) -> StrataSettings:
    """``settings`` for ``strategy`` in the gate: single on the first device with ``experts`` cached,
    the others on two device slots with half each (see the module doc)."""
    devices = list(settings.devices[:2]) if len(settings.devices) > 1 else list(settings.devices) * 2
    half = experts // 2
    options: dict[str, Any] = {}
    if strategy == "peer_tier":
        options = {"peer_slots": half}
    elif strategy == "gpu1_experts":
        options = {"slots_device1": half}
    elif strategy in ("layer_split", "prefill_main"):
        options = {"split": str(n_layers // 2)}
    values = settings.model_dump() | {"strategy": strategy, "strategy_options": options, "adapt_swaps": 0,
                                      "expert_cache": experts if strategy == "single" else half,
                                      "expert_cache_gib": None, "expert_profile": None,
                                      "devices": devices[:1] if strategy == "single" else devices}
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


def run_gate(settings: StrataSettings, strategies: Sequence[str], prompts: Sequence[str], tokens: int,
             experts: int | None, load: Callable[[StrataSettings], Any], say: Callable[[str], None] = print
             ) -> list[GateResult]:
    """Run the gate; ``load(settings) -> Engine``. ``experts``: single's cache (None: half of the
    experts). Returns one result per strategy other than single, in order."""
    unknown = [p for p in prompts if p not in GATE_PROMPTS]
    if unknown:
        raise ConfigError(f"gate: unknown prompt(s) {', '.join(unknown)}; the gate has {', '.join(GATE_PROMPTS)}")
    spec = load_model_spec(GGUFFile.open(settings.model))
    n_layers, n_experts = spec.n_layers, spec.n_experts
    total = n_layers * n_experts // 2 if experts is None else experts
    experts = total - total % (2 * n_layers)
    say(f"gate: {len(prompts)} prompt(s) x {tokens} tokens, greedy; {experts} of {n_layers * n_experts} "
        "experts on the devices of every strategy")
    want: dict[str, list[int]] = {}
    plan: set[tuple[int, int]] = set()
    results = []
    for strategy in ["single", *[s for s in strategies if s != "single"]]:
        engine = None
        try:
            engine = load(gate_settings(settings, strategy, experts, n_layers))
            held = set().union(*(set(table.resident()) for table in engine.experts.tables.values()))
            got = {name: greedy_tokens(engine, _prompt_ids(engine, name), tokens) for name in prompts}
        finally:
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if strategy == "single":
            want, plan = got, held
            say(f"{'single':<14} reference ({', '.join(settings.devices[:1])})")
            continue
        first = next(((name, i, a, b) for name in prompts for i, (a, b) in enumerate(zip(got[name], want[name]))
                      if a != b), None)
        result = GateResult(strategy, first, held == plan)
        say(result.line())
        results.append(result)
    return results
