"""Timing observer: ``STRATA_PREFILL_TIMING=1`` / ``STRATA_DECODE_TIMING=1``.

Wraps the phase hooks under any strategy and prints, per prefill chunk or decode window, the host
time (until the hook returned: enqueue time on a GPU) and the device time (until every device of the
plan finished), with the expert-residency counters of that phase. Registered only when switched on.
"""

from __future__ import annotations

import sys
import time

from strata_core.devices import synchronize
from strata_core.plugin import hookimpl


def _timed(engine, label: str, n_tokens: int):
    telemetry_before = engine.telemetry.snapshot()
    start = time.perf_counter()
    result = yield
    host_s = time.perf_counter() - start
    for device in engine.plan.devices:
        synchronize(device)
    device_s = time.perf_counter() - start
    delta = engine.telemetry.delta(telemetry_before)
    counters = " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in delta.items() if value)
    print(
        f"[strata {label}] tokens={n_tokens} host={host_s * 1e3:.2f}ms device={device_s * 1e3:.2f}ms "
        f"tok/s={n_tokens / device_s:.1f} {counters}".rstrip(),
        file=sys.stderr,
    )
    return result


@hookimpl(wrapper=True)
def strata_prefill(engine, session, tokens, all_logits):
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
