"""What a prompt pass costs by its size: ``Engine.prefill_batch`` timed for several chunk sizes and batches
of sessions, then the torch profiler over one prompt of each ``--profile`` size (kernels by GPU time, host
operations by CPU time).

    python tools/prompt_cost.py MODEL.gguf [--device cuda:0] [--expert-cache 6144] [--profile 1024,64] [--eager]
    py-spy record --format raw -o spy.txt -- python tools/prompt_cost.py MODEL.gguf --passes 60 [--profile 1024]

``--passes N`` times only N one-after-another passes of the first ``--profile`` size (after three
warm-up passes), unprofiled: what a sampling profiler from outside should see.

A pass whose wall time stays flat while its tokens grow is bound by the host's enqueueing, not the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_decode import report
from torch.profiler import ProfilerActivity, profile

from strata_core.engine import Engine

#: the chunk sizes of one session, then batches of several sessions' 1,024-token chunks
SIZES = ([16], [64], [128], [256], [512], [1024], [2048], [4096], [8192], [1024] * 4, [1024] * 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--expert-cache", default="6144")
    parser.add_argument("--profile", default="1024,64", help="prompt sizes to profile once each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=0, help="only time this many passes of the first --profile size")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (prompt passes and decode windows)")
    args = parser.parse_args()
    cache = args.expert_cache if args.expert_cache == "auto" else int(args.expert_cache)
    engine = Engine.load(args.model, devices=[args.device], arena="pinned", expert_cache=cache, max_context=9000,
                         cuda_graphs=not args.eager)
    engine.capture_prompt_graphs()  # as a server's start does: no capture in a timed pass
    gen = torch.Generator().manual_seed(0)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def prompt(n: int) -> list[int]:
        return torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist()

    def timed(sizes: list[int], repeats: int) -> float:
        """Median ms of one prompt batch of ``sizes`` chunks, each a fresh session's."""
        runs = []
        for _ in range(repeats):
            sessions = [engine.new_session() for _ in sizes]
            batch = [(session, prompt(n)) for session, n in zip(sessions, sizes)]
            sync()
            start = time.perf_counter()
            engine.prefill_batch(batch)
            sync()
            runs.append((time.perf_counter() - start) * 1e3)
            for session in sessions:
                engine.release_session(session)
        return statistics.median(runs)

    if args.passes:
        n = int(args.profile.split(",")[0])
        timed([n], 3)  # warm-up: compiles, rings
        print(f"{args.passes} passes of {n} tokens: {timed([n], args.passes):.1f} ms each (median)", flush=True)
        return
    timed([1024], 2)  # warm-up: compiles, rings
    for sizes in SIZES:
        if max(sizes) > engine.max_context - 8:
            continue
        ms = timed(sizes, args.repeats)
        name = str(sizes[0]) if len(sizes) == 1 else f"{len(sizes)} x {sizes[0]}"
        print(f"prompt {name}: {ms:.1f} ms, {sum(sizes) / ms * 1e3:.0f} tok/s", flush=True)
    for n in map(int, filter(None, args.profile.split(","))):
        session = engine.new_session()
        ids = prompt(n)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.prefill(session, ids)
            sync()
            wall = time.perf_counter() - start
        report(prof, 1, wall, f"prefill {n}", 22)
        engine.release_session(session)
        host = sorted(((e.cpu_time_total, e.count, e.key) for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CPU), reverse=True)[:25]
        for us, count, key in host:
            print(f"   host {us / 1e3:8.2f} ms {count:6d}x {key[:90]}")


if __name__ == "__main__":
    main()
