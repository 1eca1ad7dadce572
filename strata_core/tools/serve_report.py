"""The figures of a ``strata bench serve`` run: each request's measures, their summary statistics, and
the report as Markdown tables and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestResult", "decoding_seconds", "format_report", "percentile", "report", "report_json", "summary"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between the closest ranks
    (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and max of ``values`` (NaN each for none)."""
    if not values:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"), math.nan)
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


@dataclass
class RequestResult:
    """What one request measured; times in seconds from the run's start."""

    ok: bool = False
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None  # to the first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive content chunks
    chunks: int = 0  # content chunks received
    prompt_tokens: int | None = None  # from usage
    output_tokens: int = 0  # from usage, else the content chunks
    text: str = ""  # the content received (compares two runs' greedy outputs)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for fewer than two tokens)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def decoding_seconds(results: Sequence[RequestResult]) -> float:
    """How long at least one of ``results`` was decoding: the union of each request's span from its
    first token to its end. Output tokens after the first over this time is what a batched-decode
    benchmark reports (llama-batched-bench's S_TG leaves the prompts out); the gaps where no stream
    decodes (the run's first prompts, the clients between requests) are not in it."""
    spans = sorted((r.start + r.ttft, r.end) for r in results if r.ttft is not None)
    total, reach = 0.0, -math.inf
    for begin, end in spans:
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def report(results: list[RequestResult], duration: float, setup: dict[str, Any]) -> dict[str, Any]:
    """The aggregate figures of a run: counts, throughput, latency summaries (ms), the first errors,
    and each request's own figures."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    ms = 1000.0
    decoding = decoding_seconds(ok)
    after_first = sum(r.output_tokens - 1 for r in ok if r.ttft is not None)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "failed"] = errors.get(r.error or "failed", 0) + 1
    return {
        "setup": setup,
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_tok_s": output / duration if duration > 0 else math.nan,
        "total_tok_s": (output + prompt) / duration if duration > 0 else math.nan,
        "decode_tok_s": after_first / decoding if decoding > 0 else math.nan,
        "prompt_tokens": prompt, "output_tokens": output,
        "prompt_tokens_known": all(r.prompt_tokens is not None for r in ok),
        "ttft_ms": summary([r.ttft * ms for r in ok if r.ttft is not None]),
        "itl_ms": summary([gap * ms for r in ok for gap in r.itl]),
        "tpot_ms": summary([r.tpot * ms for r in ok if r.tpot is not None]),
        "e2e_ms": summary([r.e2e * ms for r in ok]),
        "errors": errors,
        "per_request": [{"ok": r.ok, "error": r.error, "start_s": r.start, "prompt_tokens": r.prompt_tokens,
                         "output_tokens": r.output_tokens, "chunks": r.chunks,
                         "ttft_ms": None if r.ttft is None else r.ttft * ms, "e2e_ms": r.e2e * ms,
                         "itl_ms": [gap * ms for gap in r.itl], "text": r.text} for r in results],
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as Markdown: the settings line, the throughput table, the latency table and, from a
    Strata server, where its worker spent the run."""
    done = max(rep["completed"], 1)
    prompt_mean = f"{rep['prompt_tokens'] / done:.1f}" if rep["prompt_tokens_known"] else "n/a"
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in rep["setup"].items()), "",
             ("| requests | failed | duration s | req/s | output tok/s | decode tok/s | total tok/s "
              "| prompt tok (mean) | output tok (mean) |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             (f"| {rep['completed']} | {rep['failed']} | {rep['duration_s']:.2f} | {rep['request_throughput']:.2f} | "
              f"{rep['output_tok_s']:.1f} | {rep['decode_tok_s']:.1f} | {rep['total_tok_s']:.1f} | {prompt_mean} | "
              f"{rep['output_tokens'] / done:.1f} |"), "",
             "| latency (ms) | mean | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|---:|"]
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
        s = rep[key]
        lines.append(f"| {name} | " + " | ".join(f"{s[k]:.1f}" for k in ("mean", "p50", "p90", "p99", "max")) + " |")
    if server := rep.get("server"):
        kept = server.get("drafts_kept", math.nan)
        lines += ["", "| server worker | steps | decode windows | tokens a window | drafts kept | in windows s "
                  "| in prompt chunks s | elsewhere s |", "|---|---:|---:|---:|---:|---:|---:|---:|",
                  (f"| from /metrics | {server['steps']:.0f} | {server['windows']:.0f} | {server['rows_per_window']:.2f} "
                   f"| {'—' if math.isnan(kept) else f'{kept:.0%}'} | {server['decode_s']:.2f} | {server['prefill_s']:.2f} "
                   f"| {server['other_s']:.2f} |")]
    for error, count in rep["errors"].items():
        lines.append(f"failed x{count}: {error}")
    return "\n".join(lines)


def report_json(rep: dict[str, Any]) -> str:
    """The report as JSON (NaN, for a figure with no values, written as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(rep), indent=2)
