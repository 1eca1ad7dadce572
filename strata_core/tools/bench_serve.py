"""``strata bench serve``: a load generator for any OpenAI-compatible server.

N closed-loop clients (each sends its next request when the previous one has finished) stream
``/v1/completions`` or ``/v1/chat/completions`` until R requests are done. Per request it records the
time to the first content chunk (TTFT), the gaps between successive content chunks (inter-token
latency, ITL), the time per output token after the first (TPOT) and the end-to-end time; the token
counts come from the final chunk's ``usage`` (``stream_options.include_usage``), else from the chunks.
The report gives requests/s, output tok/s over the run, decode tok/s (``serve_report.decoding_seconds``), and mean / p50 / p90 / p99 / max of each
latency, as a Markdown table and as JSON.

Prompts of about P tokens are random words: where the server has llama-server's ``/tokenize`` and
``/detokenize`` (Strata, llama-server) each prompt is cut to exactly P tokens of the server's own
tokenizer, else it is P words. Every prompt starts differently, so no request reuses another's prefix.
Nothing here is Strata-specific: ``--url`` points it at llama-server, vLLM or any such server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from strata_core.errors import ConfigError, StrataError
from strata_core.tools.serve_report import RequestResult, report

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


# --- requests and results --------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt text and the output tokens asked for."""

    prompt: str
    max_tokens: int


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
                if content := _chunk_text(chunk, endpoint):
                    result.text += content
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


#: the seed of the warm-up's words: a string, so no ``--prompt-seed`` gives the same words (an int seed's sign
#: is dropped: ``random.Random(-1)`` draws what ``random.Random(1)`` draws)
WARM_UP_SEED = "strata bench serve warm-up"


def warm_up_specs(like: RequestSpec, count: int) -> list[RequestSpec]:
    """``count`` requests as long as ``like`` in other words than any timed prompt (no prefix to reuse)."""
    rng = random.Random(WARM_UP_SEED)
    return [RequestSpec(random_words(rng, max(1, len(like.prompt.split()))), like.max_tokens) for _ in range(count)]


async def warm_up(target: Target, like: RequestSpec, count: int, endpoint: str, sampling: dict[str, Any],
                  timeout: float = 600.0) -> None:
    """Send ``count`` untimed requests one after another (``warm_up_specs``)."""
    extra = warm_up_specs(like, count)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        await _client(client, target, endpoint, extra, list(range(count)), sampling, time.perf_counter(),
                      [None] * count, None)


async def run_load(target: Target, specs: list[RequestSpec], clients: int, endpoint: str,
                   sampling: dict[str, Any], timeout: float = 600.0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``specs`` from ``clients`` closed-loop clients; the results in the order of ``specs`` and
    the run's duration in seconds (the first request's start to the last one's end)."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
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


#: the Strata server counters a run reads from /metrics before and after (other servers: none), and those
#: a server without speculative decoding may not have
SERVER_COUNTERS = ("steps_total", "decode_windows_total", "requests_total", "completion_tokens_total",
                   "decode_seconds_total", "prefill_seconds_total")
SPEC_COUNTERS = ("spec_draft_tokens_total", "spec_accepted_tokens_total")


async def server_counters(client: httpx.AsyncClient, target: Target) -> dict[str, float]:
    """The SERVER_COUNTERS of a Strata server's ``/metrics`` now; empty for a server without them."""
    try:
        response = await client.get(f"{target.base}/metrics", headers=target.headers)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    values = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("strata_") in SERVER_COUNTERS + SPEC_COUNTERS:
            values[name.removeprefix("strata_")] = float(value)
    return values if all(name in values for name in SERVER_COUNTERS) else {}


def server_figures(before: dict[str, float], after: dict[str, float], duration: float) -> dict[str, float]:
    """Where the server's worker spent a run of ``duration`` seconds, from its counters before and after:
    steps, decode windows and their mean tokens a request (its rows, or with speculative decoding the
    tokens it kept), seconds in windows, in prompt chunks and in neither, and the share of drafted
    tokens kept (NaN without drafts). (A finished request's first token came from its prompt's last
    chunk, every other from a window.)"""
    grown = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SERVER_COUNTERS + SPEC_COUNTERS}
    windows, rows = grown["decode_windows_total"], grown["completion_tokens_total"] - grown["requests_total"]
    drafted = grown["spec_draft_tokens_total"]
    return {
        "steps": grown["steps_total"], "windows": windows,
        "rows_per_window": rows / windows if windows else math.nan,
        "decode_s": grown["decode_seconds_total"], "prefill_s": grown["prefill_seconds_total"],
        "other_s": duration - grown["decode_seconds_total"] - grown["prefill_seconds_total"],
        "drafts_kept": grown["spec_accepted_tokens_total"] / drafted if drafted else math.nan,
    }


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
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        if options.warmup:
            await warm_up(target, specs[0], options.warmup, options.endpoint, options.sampling, options.timeout)
        before = await server_counters(client, target)
        results, duration = await run_load(target, specs, options.clients, options.endpoint, options.sampling,
                                           timeout=options.timeout, progress=options.progress)
        after = await server_counters(client, target)
    rep = report(results, duration, setup)
    if before and after:
        rep["server"] = server_figures(before, after, duration)
    if rep["completed"] == 0:
        raise BenchServeError(f"every request failed: {next(iter(rep['errors']))}")
    if rep["failed"]:
        log.warning("bench serve: %d of %d requests failed", rep["failed"], rep["requests"])
    return rep
