"""``strata bench serve``: the statistics on fixed inputs, and the load generator against a live
``strata serve`` of the demo model (one in this process, and one the command starts itself)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
from test_server_support import free_port, live_server

from strata_core.cli import main
from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.tools.bench_serve import (BenchServeError, RequestSpec, base_url, random_words, read_input,
                                           warm_up_specs)
from strata_core.tools.serve_report import RequestResult, decoding_seconds, format_report, percentile, report, report_json, summary

LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def test_the_warm_up_shares_no_prefix_with_the_prompts_of_any_seed():
    import random

    like = RequestSpec(random_words(random.Random(0), 200), 16)
    warm = [spec.prompt.split()[:16] for spec in warm_up_specs(like, 2)]
    assert len(warm[0]) == 16 and warm[0] != warm[1]
    for seed in range(-64, 65):  # --prompt-seed; an int seed's sign is dropped (-1 draws as 1)
        timed = random_words(random.Random(seed), 200).split()[:16]
        assert timed not in warm


@pytest.fixture(autouse=True)
def _no_server_log_handler_left():
    """A Litestar app sets a queue handler on the root logger that writes to this test's captured
    stderr; a later test's log records would reach it closed ("--- Logging error ---"): drop it."""
    yield
    for handler in list(logging.root.handlers):
        if type(handler).__module__.startswith("litestar"):
            logging.root.removeHandler(handler)


@pytest.fixture
def strata():
    """``strata(*args)`` runs the command in this process and gives its exit status; main's log handler
    (on this test's captured stderr) is dropped after."""

    def run(*args: str) -> int:
        handlers = list(logging.root.handlers)
        try:
            return main(list(args))
        finally:
            logging.root.handlers[:] = handlers

    return run


def test_percentile_is_numpys_linear_interpolation():
    values = [7.0, 1.0, 3.0, 10.0, 2.5, 4.0, 9.5]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="not in 0..100"):
        percentile(values, 101)
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert s == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97), "max": 4.0}


def test_decoding_time_is_the_union_of_the_streams_decode_spans():
    spans = [(0.0, 0.5, 2.0), (1.0, 0.5, 3.0), (4.0, 0.2, 5.0), (4.1, 0.1, 4.5)]  # (start, ttft, end)
    results = [RequestResult(ok=True, start=s, ttft=t, end=e) for s, t, e in spans]
    assert decoding_seconds(results) == pytest.approx((3.0 - 0.5) + (5.0 - 4.2))
    assert decoding_seconds([RequestResult(ok=True, start=0.0, end=1.0)]) == 0.0  # no first token: no decoding


def test_report_of_fixed_results():
    # two requests over 2 s: 0..1 s with 5 tokens, first at 0.2 s; 1..2 s with 3 tokens, first at 1.4 s
    a = RequestResult(ok=True, start=0.0, end=1.0, ttft=0.2, itl=[0.2, 0.2, 0.2, 0.2], chunks=5,
                      prompt_tokens=10, output_tokens=5)
    b = RequestResult(ok=True, start=1.0, end=2.0, ttft=0.4, itl=[0.3, 0.3], chunks=3, prompt_tokens=12,
                      output_tokens=3)
    failed = RequestResult(ok=False, error="HTTP 503: busy", start=0.5, end=0.6)
    rep = report([a, b, failed], 2.0, {"clients": 2})
    assert (rep["requests"], rep["completed"], rep["failed"]) == (3, 2, 1)
    assert rep["request_throughput"] == 1.0 and rep["output_tok_s"] == 4.0 and rep["total_tok_s"] == 15.0
    assert rep["decode_tok_s"] == pytest.approx((4 + 2) / (0.8 + 0.6))  # tokens after the first, while decoding
    assert rep["ttft_ms"]["p50"] == pytest.approx(300.0) and rep["ttft_ms"]["max"] == pytest.approx(400.0)
    assert rep["itl_ms"]["mean"] == pytest.approx(1400 / 6)
    assert rep["tpot_ms"]["mean"] == pytest.approx((200.0 + 300.0) / 2)  # (e2e - ttft) / (tokens - 1)
    assert rep["e2e_ms"]["p99"] == pytest.approx(1000.0)
    assert rep["errors"] == {"HTTP 503: busy": 1}
    table = format_report(rep)
    assert "| 2 | 1 | 2.00 | 1.00 | 4.0 | 4.3 | 15.0 | 11.0 | 4.0 |" in table
    assert "| TTFT | 300.0 | 300.0 | 380.0 | 398.0 | 400.0 |" in table and "failed x1: HTTP 503: busy" in table
    empty = json.loads(report_json(report([failed], 1.0, {})))
    assert empty["ttft_ms"]["p50"] is None and empty["completed"] == 0  # NaN is written as null


def test_read_input(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "one", "max_tokens": 3}\n\n{"prompt": "two"}\n')
    specs = read_input(path, default_max_tokens=7)
    assert [(s.prompt, s.max_tokens) for s in specs] == [("one", 3), ("two", 7)]
    path.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(ConfigError, match=r"requests.jsonl:2: needs an object"):
        read_input(path, 7)
    path.write_text('{"prompt": "one", "max_tokens": 0}\n')
    with pytest.raises(ConfigError, match=r":1: max_tokens must be a positive integer"):
        read_input(path, 7)


def test_base_url():
    assert base_url("http://127.0.0.1:8080/v1/") == base_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080"
    for bad in ("127.0.0.1:8080", "ftp://host/v1", "http://"):
        with pytest.raises(BenchServeError, match="http:// or https://|not a URL"):
            base_url(bad)


def _check(rep: dict, requests: int, prompt_tokens: int | None, max_tokens: int) -> None:
    assert (rep["requests"], rep["completed"], rep["failed"]) == (requests, requests, 0)
    assert rep["request_throughput"] > 0 and rep["output_tok_s"] > 0 and rep["duration_s"] > 0
    for key in LATENCIES:
        s = rep[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"] and s["mean"] > 0, (key, s)
    assert rep["ttft_ms"]["max"] <= rep["e2e_ms"]["max"]
    assert len(rep["per_request"]) == requests
    for r in rep["per_request"]:
        assert r["ok"] and 1 <= r["output_tokens"] <= max_tokens and 0 < r["ttft_ms"] < r["e2e_ms"]
        assert all(gap > 0 for gap in r["itl_ms"]) and len(r["itl_ms"]) == r["chunks"] - 1
        assert r["text"]  # what was streamed, to compare two runs' outputs
        if prompt_tokens is not None:  # cut to the length with the server's own tokenizer
            assert abs(r["prompt_tokens"] - prompt_tokens) <= 1
    assert rep["output_tokens"] == sum(r["output_tokens"] for r in rep["per_request"])


def test_bench_serve_against_a_running_server(tmp_path, capsys, strata):
    out = tmp_path / "report.json"
    lines = tmp_path / "requests.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": f"expert {i} was routed", "max_tokens": 4}) for i in range(3)))
    with live_server(StrataSettings(model_alias="demo", parallel=3)) as url:
        assert strata("bench", "serve", "--url", f"{url}/v1", "--clients", "3", "--requests", "6",
                      "--prompt-tokens", "16", "--output-tokens", "8", "--json", str(out)) == 0
        table = capsys.readouterr().out
        assert strata("bench", "serve", "--url", url, "--endpoint", "chat", "--clients", "2", "--input", str(lines),
                      "--warmup", "0") == 0
        chat = capsys.readouterr().out
    rep = json.loads(out.read_text())
    _check(rep, 6, 16, 8)
    assert rep["setup"] | {"url": None} == {"url": None, "model": "demo", "endpoint": "completions", "clients": 3,
                                            "requests": 6, "prompts": "16 tokens -> 8", "warmup": 1,
                                            "temperature": 0.0}
    assert "| latency (ms) | mean | p50 | p90 | p99 | max |" in table and "| TTFT |" in table and "| ITL |" in table
    assert f"\n| 6 | 0 | {rep['duration_s']:.2f} |" in table
    assert "endpoint=chat" in chat and "requests=3" in chat and "\n| 3 | 0 |" in chat
    # the server's counters over the timed run alone (the warm-up request before them)
    server = rep["server"]
    assert server["windows"] * server["rows_per_window"] == pytest.approx(rep["output_tokens"] - rep["completed"])
    assert 1 <= server["rows_per_window"] <= 3 and server["steps"] >= server["windows"] > 0
    assert 0 < server["decode_s"] + server["prefill_s"] <= rep["duration_s"]
    assert "| server worker | steps |" in table


def test_bench_serve_starts_strata_serve(tmp_path, capsys, strata):
    out = tmp_path / "report.json"
    assert strata("bench", "serve", "--parallel", "2", "--step-tokens", "64", "--model-alias", "demo", "--clients", "2",
                  "--requests", "2", "--prompt-tokens", "8", "--output-tokens", "4", "--warmup", "0",
                  "--json", str(out)) == 0
    rep = json.loads(out.read_text())
    _check(rep, 2, 8, 4)
    assert rep["setup"]["server"] == "strata serve" and rep["setup"]["parallel"] == 2
    assert rep["setup"]["step_tokens"] == 64
    assert "server=strata serve" in capsys.readouterr().out


@pytest.mark.parametrize("url", ["not a url", "ftp://127.0.0.1/v1", "http://127.0.0.1:{port}"])
def test_a_bad_or_unreachable_url_is_one_line(url, capsys, strata):
    code = strata("bench", "serve", "--url", url.format(port=free_port()), "--requests", "1")
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("strata: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "cannot reach http://127.0.0.1:" in errors[0] if "{port}" in url else "http:// or https://" in errors[0]


def test_bench_keeps_its_own_flags(strata, capsys):
    # `strata bench` without `serve` is still the engine bench: its flags reach it (a bad length is
    # its own error, before any model loads)
    assert strata("bench", "--prompts", "8q", "--contexts", "1k") == 2
    assert "bad length" in capsys.readouterr().err


def test_the_committed_code_editing_workload_loads() -> None:
    """tools/data/code_edit.jsonl (the speculative decoding workload: replies that repeat most of their
    prompt) is a valid --input file."""
    from pathlib import Path

    from strata_core.tools.bench_serve import read_input

    specs = read_input(Path(__file__).parent.parent / "tools" / "data" / "code_edit.jsonl", 16)
    assert len(specs) == 4 and all(s.max_tokens == 512 and "```python" in s.prompt for s in specs)
