"""``/metrics``: the scheduler's counters and the engine's telemetry as Prometheus text."""

from __future__ import annotations

from strata_core.serving.scheduler import Scheduler


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def render(scheduler: Scheduler) -> str:
    """Prometheus text exposition (version 0.0.4) of the server's state."""
    st, tel, cache, kv = scheduler.stats, scheduler.telemetry, scheduler.cache, scheduler.kv_blocks
    computed = st.prompt_tokens - st.cached_tokens
    hits, misses = float(tel.get("expert_hits", 0)), float(tel.get("expert_misses", 0))
    rows: list[tuple[str, str, str, float]] = [
        ("requests_total", "counter", "requests finished", st.requests),
        ("requests_failed_total", "counter", "requests that failed", st.failed),
        ("requests_cancelled_total", "counter", "requests cancelled (client gone)", st.cancelled),
        ("prompt_tokens_total", "counter", "prompt tokens of finished requests", st.prompt_tokens),
        ("prompt_tokens_cached_total", "counter", "prompt tokens read from a kept KV cache", st.cached_tokens),
        ("completion_tokens_total", "counter", "generated tokens", st.completion_tokens),
        ("decode_windows_total", "counter", "decode windows run", st.windows),
        ("spec_draft_tokens_total", "counter", "tokens drafted by speculative decoding", st.draft_tokens),
        ("spec_accepted_tokens_total", "counter", "drafted tokens kept", st.accepted_tokens),
        ("spec_acceptance_ratio", "gauge", "drafted tokens kept per token drafted",
         _ratio(st.accepted_tokens, st.draft_tokens)),
        ("spec_paused_windows_total", "counter", "request windows without drafts after its drafts missed",
         st.paused_windows),
        ("tokens_per_window", "gauge", "tokens generated per decode window", _ratio(st.completion_tokens, st.windows)),
        ("steps_total", "counter", "scheduler steps run (a decode window and prompt chunks)", st.steps),
        ("decode_seconds_total", "counter", "seconds the worker spent in decode windows", st.decode_seconds),
        ("prefill_seconds_total", "counter", "seconds the worker spent computing prompt chunks", st.prefill_seconds),
        ("prompt_tokens_per_second", "gauge", "prompt tokens computed per second of prefill",
         _ratio(computed, st.prompt_seconds)),
        ("decode_tokens_per_second", "gauge", "tokens generated per second of decode windows",
         _ratio(st.completion_tokens, st.decode_seconds)),
        ("requests_processing", "gauge", "requests in a slot", st.active),
        ("requests_queued", "gauge", "requests waiting for a slot (queue depth)", st.waiting),
        ("slots", "gauge", "generation slots", scheduler.parallel),
        ("kv_cached_block_hits_total", "counter", "freed KV blocks a prompt took back instead of computing them",
         kv["hits"]),
        ("kv_cached_block_evictions_total", "counter", "freed KV blocks of a published prefix given to other content",
         kv["evictions"]),
        ("kv_cached_blocks", "gauge", "free KV blocks that still hold a published prefix", kv["cached"]),
        ("conv_cache_entries", "gauge", "conversations kept in host RAM", len(cache)),
        ("conv_cache_bytes", "gauge", "host bytes held by the conversation cache", cache.nbytes),
        ("expert_cache_hit_ratio", "gauge", "routed experts found resident", _ratio(hits, hits + misses)),
        ("bytes_streamed_total", "counter", "expert bytes streamed to devices", tel.get("bytes_streamed", 0)),
    ]
    names = {r[0] for r in rows}
    for key, value in sorted(tel.items()):
        name = f"engine_{key}"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in names:
            rows.append((name, "gauge", f"engine telemetry {key}", value))
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP strata_{name} {doc}", f"# TYPE strata_{name} {kind}", f"strata_{name} {float(value)!r}"]
    by_device = scheduler.experts_by_device
    if by_device:
        lines += ["# HELP strata_experts_served_total (layer, expert) groups served, per device slot and source",
                  "# TYPE strata_experts_served_total counter"]
        lines += [f'strata_experts_served_total{{device="{device}",source="{source}"}} {float(n)!r}'
                  for device, counts in sorted(by_device.items()) for source, n in counts.items()]
    return "\n".join(lines) + "\n"
