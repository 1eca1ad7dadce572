"""Shared helpers of the server tests: a fake engine and a live uvicorn server.

The fake follows the Engine API the scheduler uses (sessions, cached prefix blocks, prefill, decode
windows, snapshots, tokenizer, chat template, telemetry) with deterministic logits from a hash of the
token history, and checks that every engine call comes from one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import tokenizers
import torch
import uvicorn

from strata_core.config import StrataSettings
from strata_core.errors import RequestError
from strata_core.serving.requests import Delta
from strata_core.serving.scheduler import Scheduler
from strata_core.serving.server import create_app
from strata_core.serving.server.http import StrataServer, uvicorn_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_SPECIAL = len(SPECIALS)
VOCAB = N_SPECIAL + 256


class FakeTokenizer:
    """Byte-level: id = byte + 3; the three specials are 0..2; EOS ids are 0 and 2."""

    eos_token_ids = {0, 2}
    encoded = 0  # characters encoded, by every instance

    def min_tokens(self, text: str) -> int:
        return -(-len(text) // max(map(len, SPECIALS)))

    @functools.cached_property
    def backend(self) -> tokenizers.Tokenizer:
        """The same vocabulary as a byte-level Hugging Face tokenizer without merges (what llguidance reads)."""
        byte_chars = _byte_level_chars()
        vocab = {s: i for i, s in enumerate(SPECIALS)} | {byte_chars[b]: b + N_SPECIAL for b in range(256)}
        backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], fuse_unk=False))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        backend.add_special_tokens(SPECIALS)
        return backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        FakeTokenizer.encoded += len(text)
        ids: list[int] = []
        while text:
            special = next((i for i, s in enumerate(SPECIALS) if text.startswith(s)), None)
            if special is not None:
                ids.append(special)
                text = text[len(SPECIALS[special]) :]
            else:
                ids.extend(b + N_SPECIAL for b in text[0].encode())
                text = text[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - N_SPECIAL for i in ids if i >= N_SPECIAL).decode(errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = True) -> FakeStreamDecoder:
        return FakeStreamDecoder(skip_special_tokens)


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level map: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


class FakeStreamDecoder:
    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.buf = b""
        self.skip = skip_special_tokens

    def push(self, token_id: int) -> str:
        if token_id < N_SPECIAL and not self.skip:
            return self.flush() + SPECIALS[token_id]
        if token_id >= N_SPECIAL:
            self.buf += bytes([token_id - N_SPECIAL])
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode()
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        return ""

    def flush(self) -> str:
        text, self.buf = self.buf.decode(errors="replace"), b""
        return text


class FakeChat:
    source = "{# ChatML, rendered in Python #}"

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@dataclass
class FakeSession:
    tokens: list[int] = field(default_factory=list)
    released: bool = False
    rewindable: bool = True  # False: a recurrent state, cut back only to 0
    unsettled: dict[int, int] = field(default_factory=dict)  # position -> the token a window fed on the "device"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def settle(self, position: int, token: int) -> None:
        """As ``Session.settle``; the token must be the one the window was fed there."""
        assert self.unsettled.pop(position) == token, (position, token)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n_tokens or (not self.rewindable and 0 < n < self.n_tokens):
            raise ValueError(f"cannot truncate {self.n_tokens} tokens to {n}")
        del self.tokens[n:]


@dataclass(frozen=True)
class FakeSnapshot:
    tokens: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 64 * len(self.tokens)


class FakeBlocks:
    """The fake's KV pools: the token prefixes of whole blocks published by sessions released with
    ``cache``, least recently used evicted beyond ``capacity`` blocks; counted as ``KVPools.counters``."""

    def __init__(self, block: int = 4, capacity: int = 64) -> None:
        self.block, self.capacity = block, capacity
        self._prefixes: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.hits = self.evictions = 0

    def share(self, tokens: Sequence[int]) -> int:
        """Positions of the published whole blocks ``tokens`` starts with (taken back: counted as hits)."""
        n = 0
        while (n + 1) * self.block <= len(tokens) and tuple(tokens[:(n + 1) * self.block]) in self._prefixes:
            n += 1
            self._prefixes.move_to_end(tuple(tokens[:n * self.block]))
            self.hits += 1
        return n * self.block

    def publish(self, tokens: Sequence[int]) -> None:
        """Publish the whole blocks of ``tokens``, evicting the least recently used beyond capacity."""
        for n in range(1, len(tokens) // self.block + 1):
            self._prefixes[tuple(tokens[:n * self.block])] = None
            self._prefixes.move_to_end(tuple(tokens[:n * self.block]))
        while len(self._prefixes) > self.capacity:
            self._prefixes.popitem(last=False)
            self.evictions += 1

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "evictions": self.evictions, "cached": len(self._prefixes)}


def fake_logits(history: list[int]) -> torch.Tensor:
    """Deterministic logits of the next token after ``history``: mostly printable ASCII."""
    seed = int.from_bytes(hashlib.blake2b(str(history).encode(), digest_size=8).digest(), "little")
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    logits[N_SPECIAL + ord("a") : N_SPECIAL + ord("z") + 1] += 3.0
    logits[N_SPECIAL + 128 :] -= 10.0
    return logits


class FakeEngine:
    """The Engine API on deterministic fake logits; ``step_delay`` seconds per engine call."""

    def __init__(self, max_context: int = 256, step_delay: float = 0.0, rewindable: bool = True) -> None:
        self.max_context = max_context
        self.spec = SimpleNamespace(vocab_size=VOCAB, context_length=max_context, rewindable=rewindable)
        self.settings = StrataSettings()
        self.tokenizer = FakeTokenizer()
        self.chat = FakeChat()
        self.step_delay = step_delay
        self.poison = FakeTokenizer().encode("\u2620")  # a prompt containing it fails in prefill
        self.prefilled: list[int] = []  # tokens computed by each prefill call, in order
        self.windows: list[int] = []  # batch size of each decode window
        self.batches: list[int] = []  # chunks of each prompt batch
        # every prefill ("prefill", session, tokens) and decode window ("window", None, rows), in order
        self.calls: list[tuple[str, FakeSession | None, int]] = []
        self.live: set[int] = set()
        self.kv_pools = FakeBlocks()
        self.shares_prefixes = rewindable  # as Engine.shares_prefixes
        self.telemetry = SimpleNamespace(snapshot=lambda: {"expert_hits": 3, "expert_misses": 1, "bytes_streamed": 42},
                                         by_device=lambda: {"cpu#0": {"resident": 3, "streamed": 1}})
        self._thread: threading.Thread | None = None

    def _check_thread(self) -> None:
        me = threading.current_thread()
        if self._thread is None:
            self._thread = me
        assert self._thread is me, "engine called from two threads"

    def _live(self, session: FakeSession) -> None:
        self._check_thread()
        assert not session.released and id(session) in self.live, "session used after release"

    def capture_decode_graphs(self, sessions: int) -> None:
        self._check_thread()
        self.captured = sessions  # what a server's start asked to capture

    def capture_prompt_graphs(self) -> None:
        self._check_thread()
        self.prompts_captured = True  # a server's start captured the prompt graphs

    def warm_up_prompts(self) -> None:
        self._check_thread()
        self.warmed = True  # a server's start warmed the prompt path

    def new_session(self, prefix_tokens=()) -> FakeSession:
        """As ``Engine.new_session``: holding the published whole blocks ``prefix_tokens`` starts with
        (here published only by ``release_session`` with ``cache``, not after each prefill)."""
        self._check_thread()
        session = FakeSession(rewindable=self.spec.rewindable)
        if self.shares_prefixes:
            session.tokens = list(prefix_tokens[:self.kv_pools.share(prefix_tokens)])
        self.live.add(id(session))
        return session

    def release_session(self, session: FakeSession, cache: bool = False) -> None:
        self._live(session)
        if cache:
            self.kv_pools.publish(session.tokens)
        session.released = True
        self.live.discard(id(session))

    def save_session(self, session: FakeSession) -> FakeSnapshot:
        self._live(session)
        return FakeSnapshot(tuple(session.tokens))

    def restore_session(self, snapshot: FakeSnapshot) -> FakeSession:
        session = self.new_session()
        session.tokens = list(snapshot.tokens)
        return session

    def _check_chunk(self, session: FakeSession, token_ids: list[int]) -> None:
        self._live(session)
        if not token_ids:
            raise RequestError("the prompt is empty")
        if session.n_tokens + len(token_ids) > self.max_context:
            raise RequestError("context is full")
        text = bytes(t - N_SPECIAL for t in token_ids if N_SPECIAL <= t < N_SPECIAL + 256)
        if bytes(t - N_SPECIAL for t in self.poison) in text:
            raise RuntimeError("poisoned prompt")

    def prefill(self, session: FakeSession, token_ids: list[int]) -> torch.Tensor:
        self._check_chunk(session, token_ids)
        time.sleep(self.step_delay)
        session.tokens.extend(token_ids)
        self.prefilled.append(len(token_ids))
        self.calls.append(("prefill", session, len(token_ids)))
        return self.next_logits(session)

    def next_logits(self, session: FakeSession) -> torch.Tensor:
        """The logits after the session's tokens (a subclass scripts its replies here)."""
        return fake_logits(session.tokens)

    def prefill_batch(self, chunks: list[tuple[FakeSession, list[int]]]) -> torch.Tensor:
        self.batches.append(len(chunks))
        for session, tokens in chunks:  # as the engine: a batch that fails commits none of its chunks
            self._check_chunk(session, tokens)
        return torch.stack([self.prefill(session, tokens) for session, tokens in chunks])

    def decode_window(self, steps: list[tuple[FakeSession, int]], fed: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Engine.decode_window``; tokens ``fed`` on the "device" are recorded as unsettled (the fake's
        logits read their values, a real session holds ``UNSET`` until they are settled)."""
        for session, _ in steps:
            self._live(session)
            if session.n_tokens + 1 > self.max_context:
                raise RequestError("context is full")
        time.sleep(self.step_delay)
        self.windows.append(len(steps))
        self.calls.append(("window", None, len(steps)))
        tokens = [t for _, t in steps] if fed is None else fed.tolist()
        for (session, _), token in zip(steps, tokens):
            if fed is not None:
                session.unsettled[session.n_tokens] = token
            session.tokens.append(token)
        return torch.stack([self.next_logits(s) for s, _ in steps])


def steps_of(calls: list[tuple[str, FakeSession | None, int]]) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of each scheduler step that ran a decode window, from
    ``FakeEngine.calls``: a step runs its window first, then its prompt chunks."""
    out: list[tuple[int, int]] = []
    for kind, _, n in calls:
        if kind == "window":
            out.append((n, 0))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + n)
    return out


def greedy_reference(prompt: list[int], max_tokens: int, eos: set[int] = FakeTokenizer.eos_token_ids) -> list[int]:
    """The greedy continuation of ``prompt`` under the fake logits, computed without the scheduler."""
    history, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(torch.argmax(fake_logits(history)))
        out.append(token)
        if token in eos:
            break
        history.append(token)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def live_server(settings: StrataSettings, engine: Any = None) -> Iterator[str]:
    """Run the app under uvicorn on 127.0.0.1 at a free port; yield its base URL."""
    with serving(settings, engine) as (url, _):
        yield url


@contextlib.contextmanager
def serving(settings: StrataSettings, engine: Any = None, ready: bool = True) -> Iterator[tuple[str, uvicorn.Server]]:
    """Like ``live_server``, yielding the base URL and the running ``uvicorn.Server``; with ``ready``
    once the model has loaded (``/health`` is no longer 503 loading)."""
    port = free_port()
    config = uvicorn_config(create_app(settings, engine), settings, host="127.0.0.1", port=port, log_level="warning")
    server = StrataServer(config, settings)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    while ready and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the model did not load")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)


def serve_together(engine: Any, requests: list, spec_tokens: int = 0, drafts: str = "ngram") -> tuple[list[str], Any]:
    """The texts of ``requests`` submitted at once to a scheduler of three slots over ``engine`` (drafting
    ``spec_tokens`` a window with ``drafts``), and the scheduler (its stats)."""
    scheduler = Scheduler(engine, parallel=3, max_queue=8, conv_cache=0, conv_cache_bytes=0, step_tokens=256,
                          spec_tokens=spec_tokens, drafts=drafts)

    async def text(handle) -> str:  # type: ignore[no-untyped-def]
        return "".join([event.text async for event in handle if isinstance(event, Delta)])

    async def main() -> list[str]:
        return await asyncio.gather(*(text(scheduler.submit(r)) for r in requests))

    scheduler.start()
    try:
        return asyncio.run(main()), scheduler
    finally:
        scheduler.stop()
