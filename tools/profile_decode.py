"""Where a decode token's time goes: torch profiler over eager decode windows on CUDA.

    python tools/profile_decode.py MODEL.gguf [--context 1024] [--windows 8] [--sessions 1,8] [--expert-cache 6144] [--cuda-graphs]
        [--strategy NAME --devices cuda:0,cuda:1 [--strategy-options name=value,...]] [--prefill 8192 [--trace prompt.json]]
        [--moe-config design=split-loop,bn_combine=4]

(``tools/trace_summary.py`` reads the ``--trace`` file: busy time per stream, the host's operations, one layer.)

Prints wall ms per token, GPU kernel ms per token (sum of kernel times), kernel launches per token,
and the kernels with the most total time, grouped by name. The wall/GPU ratio says whether the
host (launches, Python) or the device bounds the step. With several devices (a strategy's), the
kernel time of each device is printed too: whether the second device works beside the first. With ``--cuda-graphs`` the windows are
replayed graphs (captured during the warm-up), and the host time of a window's Python (until the
replay is enqueued) is printed too, with the unprofiled ms a token. ``--moe-config`` overrides fields of the
MoE kernels' ``LaunchConfig`` (strata_core/ops/moe.py) to compare designs end to end.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from strata_core.engine import Engine
from strata_core.ops import moe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--expert-cache", default="6144")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--sessions", default="1", help="sessions per decode window, e.g. 1,8,32 (each profiled in turn)")
    parser.add_argument("--prefill", type=int, default=0, help="also profile one prompt of this many tokens")
    parser.add_argument("--cuda-graphs", action="store_true", help="profile replayed CUDA graphs")
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--strategy-options", default="", help="the strategy's options: name=value,... "
                        "(validated by its options model)")
    parser.add_argument("--warm-prefill", action="store_true",
                        help="prefill one prompt of --prefill tokens unprofiled first (compiles, rings)")
    parser.add_argument("--trace", help="also write the prompt's timeline here (Chrome trace JSON, per device "
                        "and stream: where a GPU waits)")
    parser.add_argument("--moe-config", action="append",
                        help="LaunchConfig fields to override: name=value,... (repeat: each profiled in turn)")
    args = parser.parse_args()
    cache = args.expert_cache if args.expert_cache == "auto" else int(args.expert_cache)
    options = dict(item.partition("=")[::2] for item in filter(None, args.strategy_options.split(",")))
    context = max(args.context + args.windows + 8, args.prefill + 8)
    most = max(map(int, args.sessions.split(",")))
    engine = Engine.load(args.model, strategy=args.strategy, devices=args.devices.split(","), arena="pinned",
                         expert_cache=cache, strategy_options=options, max_context=context,
                         parallel=most, kv_pool_tokens=most * context, cuda_graphs=args.cuda_graphs)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, engine.spec.vocab_size, (args.context + args.windows + 4,), generator=gen).tolist()
    for spec in args.moe_config or [""]:
        try:
            config = moe.parse_launch(spec)
        except ValueError as exc:
            raise SystemExit(f"--moe-config: {exc}") from None
        print(f"MoE kernels: {config}")
        if args.cuda_graphs:
            engine.runner.graphs.invalidate()  # recaptured with this configuration's launches
        with moe.launched_with(config):
            for n_sessions in map(int, args.sessions.split(",")):
                profile_decode(engine, tokens, args, n_sessions)
    if args.prefill:
        if args.warm_prefill:
            session = engine.new_session()
            engine.prefill(session, torch.randint(0, engine.spec.vocab_size, (args.prefill,), generator=gen).tolist())
            torch.cuda.synchronize()
            engine.release_session(session)
        session = engine.new_session()
        prompt = torch.randint(0, engine.spec.vocab_size, (args.prefill,), generator=gen).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.prefill(session, prompt)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        report(prof, 1, wall, f"prefill {args.prefill} (per prompt)", args.top)
        if args.trace:
            prof.export_chrome_trace(args.trace)
            print(f"prompt timeline: {args.trace}")


def profile_decode(engine: Engine, tokens: list[int], args: argparse.Namespace, n_sessions: int) -> None:
    """Profile ``args.windows`` decode windows of ``n_sessions`` sessions after a prompt of ``args.context`` tokens."""
    sessions = [engine.new_session() for _ in range(n_sessions)]
    for session in sessions:
        engine.prefill(session, tokens[:args.context])

    def window(t: int) -> None:
        engine.decode_window([(session, t) for session in sessions])

    for t in tokens[args.context:args.context + 4]:  # warm-up: compiles, plans, captures
        window(t)
    torch.cuda.synchronize()
    steps = tokens[args.context + 4:]
    host = time.perf_counter()
    for t in steps:  # unprofiled: the host's time to enqueue a window, then the device's
        window(t)
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    unprofiled = (time.perf_counter() - host) / len(steps)
    host = (enqueued - host) / len(steps)
    for session in sessions:
        session.truncate(args.context)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for t in steps:
            window(t)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / len(steps)
    mode = "replayed graphs" if args.cuda_graphs else "eager"
    print(f"B={n_sessions}: host time to enqueue a window: {host * 1e3:.2f} ms; unprofiled {unprofiled * 1e3:.3f} ms "
          f"a window ({n_sessions / unprofiled:.1f} tok/s)")
    report(prof, len(steps), wall, f"decode @{args.context}, B={n_sessions}, {mode}, expert cache {args.expert_cache}",
           args.top)
    for session in sessions:
        engine.release_session(session)


#: CUDA runtime calls in which the host waits for a device (a host read of a device value, a sync)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def report(prof, n: int, wall: float, title: str, top: int) -> None:
    """Print the kernel time per window (``n`` of them), per device with several, the host's time
    waiting for a device, and the ``top`` kernels by total time (per device with several)."""
    totals: dict[tuple[int, str], float] = defaultdict(float)
    counts: dict[tuple[int, str], int] = defaultdict(int)
    waited = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.device_index, e.name] += e.device_time
            counts[e.device_index, e.name] += 1
        elif e.name in HOST_WAITS:
            waited += e.cpu_time_total
    per_device: dict[int, float] = defaultdict(float)
    for (device, _), us in totals.items():
        per_device[device] += us
    gpu = sum(totals.values()) / n / 1e3
    print(f"{title}: wall {wall * 1e3:.2f} ms, GPU kernels {gpu:.2f} ms, {sum(counts.values()) / n:.0f} kernels, "
          f"host waiting for a device {waited / n / 1e3:.2f} ms")
    several = len(per_device) > 1
    if several:
        print("  kernel ms per device: " + ", ".join(f"cuda:{d} {us / n / 1e3:.2f}" for d, us in sorted(per_device.items())))
    for device in sorted(per_device) if several else [None]:
        picked = {key: us for key, us in totals.items() if device is None or key[0] == device}
        for key, us in sorted(picked.items(), key=lambda kv: -kv[1])[:top]:
            where = f"cuda:{key[0]} " if several else ""
            print(f"  {us / n / 1e3:8.3f} ms  {counts[key] / n:6.0f}x  {where}{key[1][:100]}")

if __name__ == "__main__":
    main()
