"""``strata bench serve``: a load generator for any OpenAI-compatible server.

N closed-loop clients (each sends its next request when the previous one has finished) stream
``/v1/completions`` or ``/v1/chat/completions`` until R requests are done. Per request it records the
time to the first content chunk (TTFT), the gaps between successive content chunks (inter-token
latency, ITL), the time per output token after the first (TPOT) and the end-to-end time; the token
counts come from the final chunk's ``usage`` (``stream_options.include_usage``), else from the chunks.
The report gives requests/s, output tok/s over the run, and mean / p50 / p90 / p99 / max of each
latency, as a Markdown table and as JSON.

Prompts of about P tokens are random words: where the server has llama-server's ``/tokenize`` and
``/detokenize`` (Strata, llama-server) each prompt is cut to exactly P tokens of the server's own
tokenizer, else it is P words. Every prompt starts differently, so no request reuses another's prefix.
Nothing here is Strata-specific: ``--url`` points it at llama-server, vLLM or any such server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from strata_core.errors import ConfigError, StrataError

log = logging.getLogger(__name__)

#: short common English words; in most BPE vocabularies " word" is one token
WORDS = ("the of and to in is was that for on as with by he at from his it an were are which this be or "
         "had not but one they her all she there been their has have when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first "
         "any my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go came right used take "
         "three").split()


class BenchServeError(StrataError):
    """The target cannot be benchmarked: a bad or unreachable URL, a server that failed to start, every
    request refused."""


# --- statistics ------------------------------------------------------------------------------------


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


# --- requests and results --------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt text and the output tokens asked for."""

    prompt: str
    max_tokens: int


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

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for fewer than two tokens)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def read_input(path: Path, default_max_tokens: int) -> list[RequestSpec]:
    """The requests of a JSONL file: one ``{"prompt": str, "max_tokens": int}`` per line
    (``max_tokens`` optional); blank lines skipped; a bad line is an error naming it."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"--input {path}: {error.strerror or error}") from None
    specs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as error:
            raise ConfigError(f"--input {path}:{number}: not JSON ({error})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ConfigError(f"--input {path}:{number}: needs an object with a \"prompt\" string")
        max_tokens = item.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"--input {path}:{number}: max_tokens must be a positive integer")
        specs.append(RequestSpec(item["prompt"], max_tokens))
    if not specs:
        raise ConfigError(f"--input {path}: no requests in it")
    return specs


# --- the target ------------------------------------------------------------------------------------


@dataclass
class Target:
    """A server to drive: its base URL (without ``/v1``), the model name requests carry, headers."""

    base: str
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``; an error unless it is an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as error:
        raise BenchServeError(f"--url {url!r} is not a URL: {error}") from None
    if parsed.scheme not in {"http", "https"} or not parsed.host:
        raise BenchServeError(f"--url {url!r} is not an http:// or https:// URL with a host")
    return str(parsed).rstrip("/").removesuffix("/v1")


async def discover_model(client: httpx.AsyncClient, target: Target) -> str:
    """The first model of the server's ``/v1/models``; an error naming the URL when it cannot be reached
    or refuses."""
    url = f"{target.base}/v1/models"
    try:
        response = await client.get(url, headers=target.headers)
    except httpx.HTTPError as error:
        raise BenchServeError(f"cannot reach {target.base}: {one_line(error) or type(error).__name__}") from None
    if response.status_code in (401, 403):
        raise BenchServeError(f"{url} answered {response.status_code}: the server wants an API key (--api-key)")
    if response.status_code != 200:
        raise BenchServeError(f"{url} answered {response.status_code}: {one_line(response.text)[:200]}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchServeError(f"{url} did not list a model (name one with --model-alias)") from None


async def _tokenize(client: httpx.AsyncClient, target: Target, text: str) -> list[int] | None:
    """llama-server's ``/tokenize`` of ``text``, or None where the server has no such route."""
    try:
        response = await client.post(f"{target.base}/tokenize", json={"content": text}, headers=target.headers)
        tokens = response.json()["tokens"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None


async def _detokenize(client: httpx.AsyncClient, target: Target, tokens: list[int]) -> str | None:
    try:
        response = await client.post(f"{target.base}/detokenize", json={"tokens": tokens}, headers=target.headers)
        text = response.json()["content"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) else None


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


async def synthetic_prompts(client: httpx.AsyncClient, target: Target, count: int, prompt_tokens: int,
                            seed: int) -> tuple[list[str], bool]:
    """``count`` prompts of ``prompt_tokens`` tokens of the server's tokenizer (True), or of as many
    words where it has no ``/tokenize`` and ``/detokenize`` (False)."""
    rng = random.Random(seed)
    texts = [random_words(rng, prompt_tokens) for _ in range(count)]
    exact = []
    for text in texts:
        tokens = await _tokenize(client, target, text)
        if tokens is None:
            return texts, False
        words = prompt_tokens
        while len(tokens) < prompt_tokens:  # words of several tokens each: cut from fewer, never pad
            words *= 2
            text = text + " " + random_words(rng, words)
            tokens = await _tokenize(client, target, text)
            if tokens is None:
                return texts, False
        cut = await _detokenize(client, target, tokens[:prompt_tokens])
        if cut is None:
            return texts, False
        exact.append(cut)
    return exact, True


# --- one request -----------------------------------------------------------------------------------


def one_line(value: object) -> str:
    return " ".join(str(value).split())


def request_body(spec: RequestSpec, target: Target, endpoint: str, sampling: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one streaming request (``sampling`` holds temperature, ignore_eos, extra fields)."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body | sampling


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def send(client: httpx.AsyncClient, target: Target, endpoint: str, spec: RequestSpec,
               sampling: dict[str, Any], t0: float) -> RequestResult:
    """Stream one request and time it; a refusal, a stream error or a broken connection is a failed
    result with the reason, never an exception."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    result = RequestResult(start=time.perf_counter() - t0)
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", target.base + path, json=request_body(spec, target, endpoint, sampling),
                                 headers=target.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(text)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                try:
                    chunk = json.loads(data)
                except ValueError:
                    result.error = f"not JSON in the stream: {data[:100]}"
                    return result
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    result.error = f"error in the stream: {_error_message(json.dumps(chunk))}"
                    return result
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                if _chunk_text(chunk, endpoint):
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {one_line(error)}"
        return result
    finally:
        result.end = time.perf_counter() - t0
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
    else:
        result.output_tokens = result.chunks
    result.ok = result.chunks > 0
    if not result.ok:
        result.error = "no content in the stream"
    return result


def _error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the text (one line, short)."""
    try:
        error = json.loads(text)["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        message = text
    return one_line(message)[:300]


# --- the run ---------------------------------------------------------------------------------------


async def run_load(target: Target, specs: list[RequestSpec], clients: int, endpoint: str,
                   sampling: dict[str, Any], warmup: int = 0, timeout: float = 600.0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``specs`` from ``clients`` closed-loop clients, after ``warmup`` untimed requests (as long
    as the first spec, in other words); the results in the order of ``specs`` and the run's duration
    in seconds (the first request's start to the last one's end)."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        if warmup:  # the first request's shape, other words (no prefix for the timed run to reuse)
            rng = random.Random(-1)
            extra = [RequestSpec(random_words(rng, max(1, len(specs[0].prompt.split()))), specs[0].max_tokens)
                     for _ in range(warmup)]
            queue, t0 = list(range(warmup)), time.perf_counter()
            await asyncio.gather(*(_client(client, target, endpoint, extra, queue, sampling, t0, [None] * warmup,
                                           None) for _ in range(min(clients, warmup))))
        results: list[RequestResult | None] = [None] * len(specs)
        queue = list(range(len(specs)))
        with tqdm(total=len(specs), desc="bench serve", unit="req", file=sys.stderr, dynamic_ncols=True,
                  disable=None if progress else True) as bar:
            t0 = time.perf_counter()
            await asyncio.gather(*(_client(client, target, endpoint, specs, queue, sampling, t0, results, bar)
                                   for _ in range(min(clients, len(specs)))))
    done = [r for r in results if r is not None]
    duration = max(r.end for r in done) - min(r.start for r in done)
    return done, duration


async def _client(client: httpx.AsyncClient, target: Target, endpoint: str, specs: list[RequestSpec],
                  queue: list[int], sampling: dict[str, Any], t0: float, results: list[RequestResult | None],
                  bar: tqdm | None) -> None:
    """One client: take the next request of ``queue`` until it is empty."""
    while queue:
        index = queue.pop(0)
        results[index] = await send(client, target, endpoint, specs[index], sampling, t0)
        if bar is not None:
            bar.update(1)


def report(results: list[RequestResult], duration: float, setup: dict[str, Any]) -> dict[str, Any]:
    """The aggregate figures of a run: counts, throughput, latency summaries (ms), the first errors,
    and each request's own figures."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    ms = 1000.0
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
                         "itl_ms": [gap * ms for gap in r.itl]} for r in results],
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as Markdown: the settings line, the throughput table and the latency table."""
    done = max(rep["completed"], 1)
    prompt_mean = f"{rep['prompt_tokens'] / done:.1f}" if rep["prompt_tokens_known"] else "n/a"
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in rep["setup"].items()), "",
             ("| requests | failed | duration s | req/s | output tok/s | total tok/s | prompt tok (mean) "
              "| output tok (mean) |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|",
             (f"| {rep['completed']} | {rep['failed']} | {rep['duration_s']:.2f} | {rep['request_throughput']:.2f} | "
              f"{rep['output_tok_s']:.1f} | {rep['total_tok_s']:.1f} | {prompt_mean} | "
              f"{rep['output_tokens'] / done:.1f} |"), "",
             "| latency (ms) | mean | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|---:|"]
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
        s = rep[key]
        lines.append(f"| {name} | " + " | ".join(f"{s[k]:.1f}" for k in ("mean", "p50", "p90", "p99", "max")) + " |")
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


@dataclass
class LoadOptions:
    """What ``bench serve`` sends: the request shape, the load, the sampling fields."""

    clients: int = 4
    requests: int | None = None  # default: 2 x clients, or the input file's lines
    prompt_tokens: int = 256
    output_tokens: int = 128
    input_file: Path | None = None
    endpoint: str = "completions"
    warmup: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    timeout: float = 600.0
    progress: bool = True


def bench(target: Target, options: LoadOptions) -> dict[str, Any]:
    """Discover the model, build the prompts, run the load and return the report; an error when the
    target cannot be reached or every request failed."""
    return asyncio.run(_bench(target, options))


async def _bench(target: Target, options: LoadOptions) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        if not target.model:
            target.model = await discover_model(client, target)
        else:
            await discover_model(client, target)  # reachable, and the key is accepted
        if options.input_file is not None:
            specs = read_input(options.input_file, options.output_tokens)
            count = options.requests or len(specs)
            specs = [specs[i % len(specs)] for i in range(count)]
            shape = f"{options.input_file}"
        else:
            count = options.requests or 2 * options.clients
            prompts, exact = await synthetic_prompts(client, target, count, options.prompt_tokens, options.seed)
            specs = [RequestSpec(p, options.output_tokens) for p in prompts]
            shape = f"{options.prompt_tokens} {'tokens' if exact else 'words'} -> {options.output_tokens}"
    setup = {"url": target.base, "model": target.model, "endpoint": options.endpoint, "clients": options.clients,
             "requests": len(specs), "prompts": shape, "warmup": options.warmup}
    setup |= options.sampling
    results, duration = await run_load(target, specs, options.clients, options.endpoint, options.sampling,
                                       options.warmup, options.timeout, options.progress)
    rep = report(results, duration, setup)
    if rep["completed"] == 0:
        raise BenchServeError(f"every request failed: {next(iter(rep['errors']))}")
    if rep["failed"]:
        log.warning("bench serve: %d of %d requests failed", rep["failed"], rep["requests"])
    return rep


# --- a server of our own ---------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def setting_env(name: str, value: Any) -> str | None:
    """A setting's value as its ``STRATA_*`` variable reads it (None: leave the variable unset)."""
    if value is None:
        return None
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return os.fspath(value) if isinstance(value, Path) else str(value)


@contextlib.contextmanager
def strata_server(settings: dict[str, Any], startup_timeout: float = 900.0) -> Iterator[str]:
    """Run ``strata serve`` with ``settings`` (setting name -> value, passed as ``STRATA_*`` variables)
    in a subprocess, its log in a file; yield its base URL once ``/health`` answers 200, and stop it
    after. A server that exits or does not become ready in ``startup_timeout`` seconds is an error with
    the last line of its log."""
    env = dict(os.environ)
    for name, value in settings.items():
        text = setting_env(name, value)
        if text is None:
            env.pop(f"STRATA_{name.upper()}", None)
        else:
            env[f"STRATA_{name.upper()}"] = text
    host = "127.0.0.1" if settings.get("host") in (None, "0.0.0.0", "::") else settings["host"]
    url = f"http://{host}:{settings.get('port')}"
    log_file = tempfile.NamedTemporaryFile("w+", prefix="strata-serve-", suffix=".log", delete=False)
    log.info("bench serve: starting strata serve at %s (log in %s)", url, log_file.name)
    process = subprocess.Popen([sys.executable, "-m", "strata_core", "serve"], env=env, stdout=log_file,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ok = False
    try:
        _wait_ready(process, url, Path(log_file.name), startup_timeout)
        yield url
        ok = True
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log_file.close()
        if ok:  # kept, and named in the error, when something went wrong
            Path(log_file.name).unlink(missing_ok=True)


def _wait_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise BenchServeError(f"strata serve exited with status {process.returncode}: "
                                      f"{_last_line(log_path)} (log: {log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise BenchServeError(f"strata serve was not ready after {timeout:.0f} s (log: {log_path})")
            time.sleep(0.1)  # polling for readiness, nothing is timed here


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"
