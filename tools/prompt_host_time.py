"""Unprofiled host time a prompt layer spends in the expert path, per function: where the host's time
goes when a prompt is host-bound.

    python tools/prompt_host_time.py MODEL [--strategy peer_tier --devices cuda:0,cuda:1]
        [--strategy-options '{"peer_prefill_rows": 0}'] [--expert-cache 2048] [--prompt 8192] [--repeats 3]

Wall-clock timers wrap the expert path's functions (``TIMED``); after two warm prompts, ``--repeats``
prompts are timed and each function's time is printed per MoE layer, with its calls per layer. On CUDA
the host only enqueues, so a function's time is its enqueueing plus any wait inside it: the grouped
prefill's routing read (in ``_grouped``) is where a GPU-bound prompt waits, so ``_grouped`` well above
the sum of its parts says the GPU, not the host, bounds the prompt. Unlike ``profile_decode --trace``
nothing here slows the host down.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict

import torch

from strata_core.runtime.devices import synchronize
from strata_core.engine import Engine
from strata_core.experts import device_rows, grouped, grouped_prefill
from strata_core.experts.chain import Chain
from strata_core.experts.prompt_plan import PromptPlanner

#: (owner, attribute) of the functions timed: the grouped prefill's layer, its parts and the planning.
TIMED = [(grouped_prefill.GroupedPrefill, "_grouped"), (grouped_prefill.GroupedPrefill, "_on_peer"),
         (grouped_prefill.GroupedPrefill, "_prefetch"), (PromptPlanner, "plan"), (grouped_prefill, "assign"),
         (device_rows.CachedExpertRows, "rows"), (Chain, "holders"), (grouped_prefill, "grouped_rows"),
         (grouped, "dequantize_experts"), (grouped, "grouped_ffn"), (device_rows, "combine_sorted")]


def install_timers(seconds: dict[str, float], calls: dict[str, int]) -> None:
    """Wrap every ``TIMED`` function so that its wall time and calls add up under its name."""
    for owner, name in TIMED:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start
                calls[_name] += 1

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--strategy-options", default="{}", help="the strategy's options as JSON")
    parser.add_argument("--expert-cache", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    engine = Engine.load(args.model, strategy=args.strategy, devices=args.devices.split(","), arena="pinned",
                         expert_cache=args.expert_cache, strategy_options=json.loads(args.strategy_options),
                         max_context=args.prompt + 8)
    gen = torch.Generator().manual_seed(0)

    def prompt() -> float:
        session = engine.new_session()
        tokens = torch.randint(0, engine.spec.vocab_size, (args.prompt,), generator=gen).tolist()
        for slot in engine.devices:
            synchronize(slot.device)
        start = time.perf_counter()
        engine.prefill(session, tokens)
        for slot in engine.devices:
            synchronize(slot.device)
        engine.release_session(session)
        return time.perf_counter() - start

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    install_timers(seconds, calls)
    prompt(), prompt()  # compiles, rings, caches
    seconds.clear(), calls.clear()
    walls = [prompt() for _ in range(args.repeats)]
    layers = args.repeats * engine.spec.n_layers
    print(f"{args.strategy} {args.strategy_options}: {[round(args.prompt / w) for w in walls]} tok/s, "
          f"{sum(walls) / layers * 1e3:.2f} ms a layer")
    for name, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {name:20s} {total / layers * 1e3:7.3f} ms a layer  {calls[name] / layers:5.1f} calls a layer")


if __name__ == "__main__":
    main()
