"""``strata bench``: prefill and decode tok/s with the cache settings, hit rate and link GB/s beside each."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import Field
from pydantic_settings import CliApp, CliSubCommand, get_subcommand

from strata_core.cli.bench_serve import BenchServeCommand
from strata_core.cli.settings import ENGINE, settings_with

log = logging.getLogger(__name__)


def fitting_lengths(prompts: list[int], contexts: list[int], decode_tokens: int,
                    max_context: int) -> tuple[list[int], list[int]]:
    """The prompt and decode-context lengths that fit in ``max_context`` tokens; the others are
    skipped with a note. When none of a kind fits, the longest that does is measured instead."""
    fit_prompts = [n for n in prompts if n <= max_context]
    fit_contexts = [c for c in contexts if c + decode_tokens <= max_context]
    skipped = [f"prefill {n}" for n in prompts if n not in fit_prompts]
    skipped += [f"decode @{c}" for c in contexts if c not in fit_contexts]
    if skipped:
        log.warning("bench: skipped %s: beyond the context of %d tokens", ", ".join(skipped), max_context)
    if prompts and not fit_prompts:
        fit_prompts = [max_context]
    if contexts and not fit_contexts and max_context > decode_tokens:
        fit_contexts = [max_context - decode_tokens]
    if fit_prompts != [n for n in prompts if n <= max_context] or fit_contexts != [
            c for c in contexts if c + decode_tokens <= max_context]:
        log.warning("bench: measuring prefill %s and decode @%s instead", fit_prompts, fit_contexts)
    return fit_prompts, fit_contexts


def llamacpp_at_budget(engine, budget_gib: float, prompts: list[int], decode_tokens: int, depths: list[int]) -> str:
    """The lines naming llama.cpp's placement at the same budget: the ``--n-cpu-moe`` that fits (an
    estimate from the file's tensors, llamacpp_budget.py) and the llama-bench commands of the comparison
    (prefill at ``prompts``, decode of ``decode_tokens`` at ``depths``), the KV cache in the llama.cpp type
    matching ``--kv-type``."""
    import os

    from strata_core.experts.sizing import GIB
    from strata_core.tools.llamacpp_budget import llama_bench_commands, llama_cache_type, n_cpu_moe_for_budget

    sizes = {name: t.nbytes for name, t in engine.gguf_file.tensors.items()}
    cache_type = llama_cache_type(engine.settings.kv_type)
    placed = n_cpu_moe_for_budget(sizes, engine.spec, int(budget_gib * GIB), engine.max_context, cache_type)
    if placed is None:
        return f"llama.cpp at --vram-budget-gib {budget_gib:g}: nothing fits, even with every expert in host RAM"
    commands = llama_bench_commands(engine.settings.model, placed.n_cpu_moe, prompts, decode_tokens, depths,
                                    os.cpu_count() or 1, cache_type)
    return "\n".join([f"llama.cpp at --vram-budget-gib {budget_gib:g} (estimate: weights {placed.weights / GIB:.2f} + "
                      f"KV {placed.kv / GIB:.2f} ({cache_type}) + buffers {placed.buffers / GIB:.2f} GiB; llamacpp.sh placement "
                      f"cmoe{placed.n_cpu_moe}-pin):", *commands])


class BenchCommand(settings_with(ENGINE)):  # type: ignore[misc]
    """Measure prefill tok/s at prompt lengths and decode tok/s at context lengths (median of runs).

    `strata bench serve` instead load-tests an HTTP server (see `strata bench serve --help`).
    """

    prompts: str = Field("8k,32k", description="prompt lengths for prefill, e.g. 512,8k,32k")
    contexts: str = Field("1k,32k", description="context lengths for decode")
    decode_tokens: int = Field(32, ge=1, description="decode windows timed per run")
    sessions: str = Field("1", description="concurrent sessions per decode window, e.g. 1,4 (tok/s summed)")
    sampled: bool = Field(False, description="also time decode fed its own argmax, read on the host each token "
                                             "(decode-sampled: what a greedy generation loop gets)")
    repeats: int = Field(3, ge=1, description="runs per figure (the median is reported)")
    json_file: Path | None = Field(None, alias="json", description="write the results as JSON here")
    serve: CliSubCommand[BenchServeCommand] = Field(description="load-test an OpenAI-compatible server over HTTP")

    def cli_cmd(self) -> None:
        """Load the engine, run every figure, print the table (and write the JSON); or run
        `bench serve`."""
        if get_subcommand(self, is_required=False) is not None:
            CliApp.run_subcommand(self)
            return
        from strata_core.engine import Engine
        from strata_core.runtime.heap import freeze_loaded
        from strata_core.tools.bench import (copy_gbps, format_table, machine_name, parse_lengths,
                                        results_json, run_bench)

        prompts, contexts = parse_lengths(self.prompts), parse_lengths(self.contexts)
        need = max(prompts + [c + self.decode_tokens for c in contexts])
        max_context = max(self.max_context, need)
        # the KV pool holds the concurrent sessions of the largest decode figure and a warm-up session
        pool = self.kv_pool_tokens or max(parse_lengths(self.sessions)) * (need + 1) + max_context
        engine = Engine.from_settings(self.strata_settings(max_context=max_context, kv_pool_tokens=pool))
        freeze_loaded()  # no full collection scanning the engine inside a timed run
        prompts, contexts = fitting_lengths(prompts, contexts, self.decode_tokens, engine.max_context)
        try:
            setup = {"model": self.model.name, "devices": ",".join(self.devices), "machine": machine_name(
                list(dict.fromkeys(slot.device for slot in engine.devices))), "arena": self.arena, "expert_cache": self.expert_cache,
                "resident": sum(t.n_resident for t in engine.experts.tables.values()),
                "experts": len(engine.spec.moe_layers) * engine.spec.n_experts, "pcie_frac": self.pcie_frac,
                "cpu_prompt_tokens": engine.experts.cpu_prompt_tokens,
                "adapt_swaps": self.adapt_swaps, "prefill_chunk": self.prefill_chunk, "repeats": self.repeats,
                "strategy": self.strategy, "sessions": self.sessions}
            if self.vram_budget_gib is not None:
                setup["vram_budget_gib"] = self.vram_budget_gib
            for name, source in (("pinned_h2d_gbps", "pinned"), ("device_copy_gbps", "device")):
                rate = copy_gbps(engine.runner.main.device, source)
                if rate is not None:
                    setup[name] = round(rate, 1)
            results = run_bench(engine, prompts, contexts, self.repeats, self.decode_tokens,
                                tuple(parse_lengths(self.sessions)), self.sampled)
            peer = (None if self.vram_budget_gib is None else
                    llamacpp_at_budget(engine, self.vram_budget_gib, prompts, self.decode_tokens, contexts))
        finally:
            engine.close()
        print(format_table(results, setup))
        if peer is not None:
            print("\n" + peer)
        if self.json_file is not None:
            self.json_file.write_text(json.dumps(results_json(results, setup), indent=2))
            log.info("bench results written to %s", self.json_file)
