"""``strata bench``: prefill tok/s at prompt lengths and decode tok/s at context lengths.

Each figure is the median of ``repeats`` runs on fresh sessions with seeded random token ids,
after one untimed warm-up (kernel compilation), timed until every device of the plan has finished, and reported with the expert telemetry of
those runs (hit rate, link GB/s, bytes streamed; routed-expert bytes read a second of the run and of
expert compute) and the cache settings in effect.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from strata_core.runtime.devices import PendingRead, synchronize
from strata_core.errors import ConfigError

if TYPE_CHECKING:
    from strata_core.engine import Engine

__all__ = ["BenchResult", "format_table", "warm_up", "copy_gbps", "machine_name", "parse_lengths", "results_json", "run_bench"]


@dataclass
class BenchResult:
    """One figure: ``kind`` is "prefill" (``length`` = prompt tokens), "decode" (``length`` = context; the
    windows are fed known tokens, so the host enqueues the next while the device runs) or
    "decode-sampled" (each window fed the argmax of the previous one's logits on the device, the argmax
    read on the host one window behind: the loop a greedy generation runs with overlapped windows, host
    time included)."""

    kind: str
    length: int
    tok_s: float
    runs: list[float]
    hit_rate: float
    link_gbps: float
    bytes_streamed: int
    expert_gbps: float = 0.0  # routed-expert bytes computed per second of the figure's wall time
    kernel_gbps: float = 0.0  # the same per second of expert compute
    sessions: int = 1


def parse_lengths(text: str) -> list[int]:
    """``"512,8k,32K"`` -> ``[512, 8192, 32768]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part.rstrip("k")) * scale)
        except ValueError:
            raise ConfigError(f"bad length {part!r}: use numbers like 512, 8k, 32k") from None
    if not out or min(out) < 1:
        raise ConfigError(f"no lengths in {text!r}")
    return out


def _tokens(engine: Engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist()


def _sync(engine: Engine) -> None:
    for slot in engine.devices:
        synchronize(slot.device)


def _result(kind: str, length: int, runs: list[float], deltas: list[dict[str, Any]], tokens: int,
            sessions: int = 1) -> BenchResult:
    """The median of ``runs`` (tok/s of ``tokens`` tokens each) with the telemetry of all runs
    (``ExpertTelemetry.delta`` each); the expert GB/s is the bytes of routed experts a token times the median tok/s."""
    total = {k: sum(d[k] for d in deltas)
             for k in ("expert_hits", "expert_misses", "bytes_streamed", "copy_s", "expert_bytes", "compute_s")}
    routed = total["expert_hits"] + total["expert_misses"]
    tok_s = statistics.median(runs)
    return BenchResult(kind, length, tok_s, runs,
                       hit_rate=total["expert_hits"] / routed if routed else 1.0,
                       link_gbps=total["bytes_streamed"] / total["copy_s"] / 1e9 if total["copy_s"] else 0.0,
                       bytes_streamed=int(total["bytes_streamed"]), sessions=sessions,
                       expert_gbps=total["expert_bytes"] / (tokens * len(runs)) * tok_s / 1e9,
                       kernel_gbps=total["expert_bytes"] / total["compute_s"] / 1e9 if total["compute_s"] else 0.0)


def _timed(engine: Engine, work) -> tuple[float, dict[str, Any]]:
    """Seconds ``work()`` takes until every device is done, and the telemetry it produced."""
    before = engine.telemetry.snapshot()
    _sync(engine)
    start = time.perf_counter()
    work()
    _sync(engine)
    return time.perf_counter() - start, engine.telemetry.delta(before)


def bench_prefill(engine: Engine, length: int, repeats: int) -> BenchResult:
    """Median prefill tok/s of a ``length``-token prompt."""
    runs, deltas = [], []
    for r in range(repeats):
        tokens = _tokens(engine, length, seed=r)
        session = engine.new_session()
        seconds, delta = _timed(engine, lambda: engine.prefill(session, tokens))
        engine.release_session(session)
        runs.append(length / seconds)
        deltas.append(delta)
    return _result("prefill", length, runs, deltas, length)


def bench_decode(engine: Engine, context: int, steps: int, repeats: int, sessions: int = 1,
                 sampled: bool = False) -> BenchResult:
    """Median decode tok/s (summed over ``sessions`` concurrent sessions) of ``steps`` windows after a
    ``context``-token prompt each; ``sampled``: each window's tokens are the previous logits' argmax."""
    runs, deltas = [], []
    for r in range(repeats):
        streams = [_tokens(engine, context + steps + 1, seed=1000 + r * sessions + i) for i in range(sessions)]
        live = [engine.new_session() for _ in streams]
        for session, tokens in zip(live, streams):
            engine.prefill(session, tokens[:context])

        def windows() -> None:
            fed = [tokens[context] for tokens in streams]  # each session's next token
            if sampled:
                return _sampled_windows(engine, live, fed, steps)
            for step in range(context + 1, context + steps + 1):
                engine.decode_window(list(zip(live, fed)))
                fed = [tokens[step] for tokens in streams]

        seconds, delta = _timed(engine, windows)
        for session in live:
            engine.release_session(session)
        runs.append(sessions * steps / seconds)
        deltas.append(delta)
    return _result("decode-sampled" if sampled else "decode", context, runs, deltas, sessions * steps, sessions)


def _sampled_windows(engine: Engine, sessions: list, first: list[int], steps: int) -> None:
    """``steps`` windows, each fed the argmax of the one before on the device; each argmax is copied to
    the host without a wait and read there one window later, when its tokens are settled in the
    sessions (as the server's overlapped windows)."""
    steps_of = [(session, token) for session, token in zip(sessions, first)]
    argmax, copied = None, None  # the last window's argmax on the device, and its host copy in flight
    for _ in range(steps):
        positions = [session.n_tokens for session in sessions]
        logits = engine.decode_window(steps_of, argmax)
        if copied is not None:  # the tokens the window was fed, known on the host now
            for session, position, token in zip(sessions, positions, copied.tolist()):
                session.settle(position, token)
        argmax = logits.argmax(-1)
        copied = PendingRead(argmax)


def warm_up(engine: Engine, prompt: int = 64) -> None:
    """A ``prompt``-token prompt, two decode windows fed known tokens and three fed as ``--sampled`` feeds
    them, on a throw-away session, untimed: the first call of each kernel compiles it (Triton) or plans it (cuDNN /
    flash attention, cuBLAS), and the caching allocators grow to the working set (the device's to the
    chunk's, the pinned host one by the argmax copies of ``--sampled``), which would otherwise land in
    the first timed run (on CUDA, after only a 64-token warm-up, the first 8K prefill ran at well under
    half the speed of the second)."""
    session = engine.new_session()
    n = min(prompt + 5, engine.max_context)
    tokens = _tokens(engine, n, seed=999_999)
    engine.prefill(session, tokens[:n - 5])
    for token in tokens[n - 5:n - 3]:
        engine.decode_window([(session, token)])
    _sampled_windows(engine, [session], [tokens[n - 3]], 3)
    _sync(engine)
    engine.release_session(session)


def run_bench(engine: Engine, prompts: list[int], contexts: list[int], repeats: int, steps: int,
              sessions: tuple[int, ...] = (1,), sampled: bool = False) -> list[BenchResult]:
    """Every prefill and decode figure (decode once per count of concurrent ``sessions``; with ``sampled``
    also as greedy generation feeds it), in order, after the capture of the decode graphs of every batch
    bucket up to the most sessions, an untimed :func:`warm_up` and the capture of the prompt graphs."""
    need = max(prompts + [c + steps for c in contexts])
    if need > engine.max_context:
        model_limit = engine.max_context == engine.spec.context_length
        raise ConfigError(f"the bench needs {need} tokens of context, the engine has {engine.max_context} ("
                          + ("the model's context length; lower --prompts / --contexts)" if model_limit else
                             "raise --max-context, or lower --prompts / --contexts)"))
    if contexts:  # as a server's start does, decode graphs first (prompt graphs go when one is captured after
        engine.capture_decode_graphs(max(sessions))  # them), and no capture in a timed pass or window
    warm_up(engine, min(max(prompts, default=64), engine.settings.prefill_chunk))
    engine.capture_prompt_graphs()
    results = [bench_prefill(engine, n, repeats) for n in prompts]
    results += [bench_decode(engine, c, steps, repeats, n, feed) for c in contexts for n in sessions
                for feed in ((False, True) if sampled else (False,))]
    return results


def copy_gbps(device: torch.device, source: str = "pinned", nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Copy bandwidth into ``device`` in GB/s (bytes copied a second, median of ``repeats``); None off CUDA.

    ``source`` "pinned": from pinned host memory, the reference of the bench's link GB/s (misses move
    no faster); "device": within ``device``, the reference of a decode step's weight reads (HBM).
    """
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=source == "pinned",
                      device=device if source == "device" else "cpu")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(rates)


def machine_name(devices: list[torch.device]) -> str:
    """The CPU model and core count, plus GPU names."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = {torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"}
    return ", ".join([f"{cpu} ({os.cpu_count()} cores)", *sorted(gpus)])


def format_table(results: list[BenchResult], setup: dict[str, Any]) -> str:
    """A Markdown table of the results with the settings line above it."""
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in setup.items()), "",
             "| phase | tokens | sessions | tok/s (median) | runs | hit rate | link GB/s | MB streamed "
             "| expert GB/s | expert GB/s of compute |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        runs = " / ".join(f"{x:.1f}" for x in r.runs)
        lines.append(f"| {r.kind} | {r.length} | {r.sessions} | {r.tok_s:.1f} | {runs} | {r.hit_rate:.1%} | "
                     f"{r.link_gbps:.2f} | {r.bytes_streamed / 1e6:.1f} | {r.expert_gbps:.2f} | {r.kernel_gbps:.2f} |")
    return "\n".join(lines)


def results_json(results: list[BenchResult], setup: dict[str, Any]) -> dict[str, Any]:
    """The JSON ``--json`` writes: the settings and every figure."""
    return {"setup": setup, "results": [asdict(r) for r in results]}
