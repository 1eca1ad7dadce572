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


def _timed(engine, label: str, n_tokens: int):
    telemetry_before = engine.telemetry.snapshot()
    by_device_before = engine.telemetry.by_device()
    engine.stage_times = []
    start = time.perf_counter()
    try:
        result = yield
        host_s = time.perf_counter() - start
        for slot in engine.devices:
            synchronize(slot.device)
        device_s = time.perf_counter() - start
        stages = " ".join(f"[{name}]={_seconds(a, b) * 1e3:.2f}ms" for name, a, b in engine.stage_times)
    finally:
        engine.stage_times = None
    delta = engine.telemetry.delta(telemetry_before)
    counters = " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in delta.items() if value)
    per_device = " ".join(
        f"{device}:" + ",".join(f"{k}={v - by_device_before.get(device, {}).get(k, 0)}" for k, v in counts.items()
                                if v - by_device_before.get(device, {}).get(k, 0))
        for device, counts in engine.telemetry.by_device().items())
    print(
        f"[strata {label}] tokens={n_tokens} host={host_s * 1e3:.2f}ms device={device_s * 1e3:.2f}ms "
        f"tok/s={n_tokens / device_s:.1f} {stages} {counters} {per_device}".rstrip(),
        file=sys.stderr,
    )
    return result


@hookimpl(wrapper=True)
def strata_prefill(engine, session, tokens, logits):
    """Time one prefill chunk."""
    if not engine.settings.prefill_timing:
        return (yield)
    return (yield from _timed(engine, "prefill", int(tokens.numel())))


@hookimpl(wrapper=True)
def strata_decode_window(engine, batch):
    """Time one decode window."""
    if not engine.settings.decode_timing:
        return (yield)
    return (yield from _timed(engine, "decode", len(batch)))
