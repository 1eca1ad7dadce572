"""Timing observer: ``STRATA_PREFILL_TIMING=1`` / ``STRATA_DECODE_TIMING=1``.

Wraps the phase hooks under any strategy and prints, per prefill chunk or decode window, the host
time (until the hook returned: enqueue time on a GPU), the device time (until every device slot
finished), each segment's (stage's) own device time, and the expert-residency counters of that
phase, in all and per device slot. Registered only when switched on.
"""

from __future__ import annotations

import sys
import time

from strata_core.runtime.devices import synchronize
from strata_core.plugin import hookimpl


def _seconds(start, end) -> float:
    """A stage's time: CUDA events (resolved after the sync) or wall-clock floats."""
    return start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start


def _timed(ctx, label: str, n_tokens: int):
    telemetry_before = ctx.telemetry.snapshot()
    by_device_before = ctx.telemetry.by_device()
    with ctx.time_stages() as stage_times:
        start = time.perf_counter()
        result = yield
        host_s = time.perf_counter() - start
        for slot in ctx.devices:
            synchronize(slot.device)
        device_s = time.perf_counter() - start
        stages = " ".join(f"[{name}]={_seconds(a, b) * 1e3:.2f}ms" for name, a, b in stage_times)
    delta = ctx.telemetry.delta(telemetry_before)
    counters = " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in delta.items() if value)
    per_device = " ".join(
        f"{device}:" + ",".join(f"{k}={v - by_device_before.get(device, {}).get(k, 0)}" for k, v in counts.items()
                                if v - by_device_before.get(device, {}).get(k, 0))
        for device, counts in ctx.telemetry.by_device().items())
    print(
        f"[strata {label}] tokens={n_tokens} host={host_s * 1e3:.2f}ms device={device_s * 1e3:.2f}ms "
        f"tok/s={n_tokens / device_s:.1f} {stages} {counters} {per_device}".rstrip(),
        file=sys.stderr,
    )
    return result


@hookimpl(wrapper=True)
def strata_prefill(ctx, batch, logits):
    """Time one prompt batch."""
    if not ctx.settings.prefill_timing:
        return (yield)
    return (yield from _timed(ctx, "prefill", int(batch.tokens.numel())))


@hookimpl(wrapper=True)
def strata_decode_window(ctx, batch):
    """Time one decode window."""
    if not ctx.settings.decode_timing:
        return (yield)
    return (yield from _timed(ctx, "decode", len(batch)))
