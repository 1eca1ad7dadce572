"""``--cuda-graphs`` for prompt passes: a pass of new sessions captured once per token bucket and replayed.

A prompt pass of a few thousand tokens or fewer is host-bound: about a hundred launches a layer at tens of
microseconds of host time each, against ~77 ms of kernels for 1,024 tokens of the 30B (BENCHMARKS.md). Where
the pass is a fixed sequence of device ops it is captured as one graph, so its time is the kernels':

- every session starts at position 0 (no cached prefix to read), their chunks packed end to end and padded
  to the next of :data:`PROMPT_BUCKETS` tokens; each session's last row gets logits;
- the model's plain attention (``MoEModel.packs_prompts``): each layer writes every row's K/V at its row id
  and runs one varlen causal attention over the pass's own rows (``MoEModel.attention_packed``), float KV;
- one device slot computes every layer, and its cache holds every expert of every layer: the grouped
  prefill then plans from the residency and reads nothing on the host (``CachedExpertRows._grouped``).

Static inputs, refilled before each replay: the token ids, positions, each row's KV row id (padding rows
write the padding session's first row, which nothing reads), the sessions' bounds (``cu_seqlens``: the
padding rows are one more sequence, absent sessions empty ones), each session's last row, and how many
(token, expert) pairs are real (the padding's are computed, not counted). The graphs of every bucket share
one memory pool (captured largest first); a change in the residency drops them, and so does a decode graph
captured after them: replayed after a later decode capture, a prompt graph read memory that was no longer its
own (an illegal address), while prompt graphs captured after the decode graphs (a server's start, ``strata
bench``) serve.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from strata_core.experts.backend import ExpertBackend
from strata_core.model.packed import PackedKV
from strata_core.model.transformer import MoEModel
from strata_core.runtime.buckets import BatchPadding
from strata_core.runtime.graphs import _Graph, _staged, account, capture_graph
from strata_core.runtime.session import PromptBatch, Session

__all__ = ["PROMPT_BUCKETS", "PromptGraphs", "prompt_bucket", "why_not_packed"]

log = logging.getLogger(__name__)

#: the token counts prompt passes are captured at (a pass of more tokens runs eagerly: it is bound by its kernels)
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def prompt_bucket(n: int, largest: int = PROMPT_BUCKETS[-1]) -> int | None:
    """The token count a pass of ``n`` tokens is padded to, or None beyond ``largest``."""
    return next((b for b in PROMPT_BUCKETS if n <= b <= largest), None)


def why_not_packed(model: MoEModel, experts: ExpertBackend, slot: int, layers: range, device: torch.device,
                   padding: Session, name: str) -> str | None:
    """Why the prompt passes of device slot ``slot`` (``name``, on CUDA ``device``, computing ``layers``) cannot
    be captured, from the GPU, the model, the KV and the expert cache; None when they can (``padding``: the
    padding session, whose KV says the pools' format and homes)."""
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability(device) < (9, 0):
        return "the grouped prefill reads its counts on the host below compute capability 9.0"
    dtype = model.weights.globals["token_embd.weight"].dtype
    if not model.packs_prompts or dtype not in (torch.bfloat16, torch.float16):
        return "the model's prompt attention is not the plain packed one in bf16 / fp16"
    if padding.kv.kv_format is not None:
        return "a quantized KV cache"
    rows = experts.rows_for(slot, "prompt")
    if not rows.grouped or not all(rows.holds_every_expert(layer) for layer in layers):
        return f"the expert cache of {name} does not hold every expert of every layer"
    if any(padding.kv.home[layer] != slot for layer in layers):
        return "the decode placement keeps a layer on another device slot"
    return None


class PromptGraphs:
    """The CUDA graphs of one device slot's prompt passes (see the module's docstring).

    :param model: the forward; ``layers`` the layers the slot computes (all of them)
    :param experts: the backend whose prompt rows of ``slot`` compute the experts
    :param padding: the padding session's holder (its first KV row takes the padding rows' writes)
    :param max_sessions: the most sessions one pass packs (the server's slots)
    :param largest: the largest bucket captured
    :param decode_captures: how many decode graphs the engine has captured so far
    """

    def __init__(self, model: MoEModel, layers: range, experts: ExpertBackend, slot: int, device: torch.device,
                 padding: BatchPadding, max_sessions: int, largest: int, decode_captures: Callable[[], int]):
        self.model, self.layers, self.experts, self.slot, self.device = model, layers, experts, slot, device
        self.padding, self.max_sessions, self.decode_captures = padding, max_sessions, decode_captures
        self.buckets = tuple(b for b in PROMPT_BUCKETS if b <= largest)
        self._graphs: dict[int, _Graph] = {}
        self._captured_after: tuple[tuple[int, ...], int] | None = None  # residency versions, decode captures
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self.failed: str | None = None  # a graph failed: prompt passes run eagerly from then on

    # --- when a pass replays -----------------------------------------------------------------------

    def why_not(self, batch: PromptBatch) -> str | None:
        """Why ``batch`` cannot replay a graph, or None when it can."""
        if self.failed is not None:
            return self.failed
        if prompt_bucket(len(batch.tokens), self.buckets[-1]) is None:
            return f"a pass of {len(batch.tokens)} tokens is beyond the largest bucket ({self.buckets[-1]})"
        if len(batch) > self.max_sessions:
            return f"{len(batch)} sessions are more than {self.max_sessions}"
        if any(s.n_tokens for s in batch.sessions):
            return "a session continues from cached positions"
        rows = self.experts.rows_for(self.slot, "prompt")
        if not all(rows.holds_every_expert(layer) for layer in self.layers):  # read once per residency change
            return "the expert cache no longer holds every expert"
        if any(s.kv.home[layer] != self.slot for s in batch.sessions for layer in self.layers):
            return "a session keeps a layer on another device slot"
        return None

    def run(self, batch: PromptBatch) -> torch.Tensor:
        """Float32 logits ``[len(batch), vocab]`` of each session's last row, by the replayed graph of the pass's
        bucket (captured first where needed); ``why_not(batch)`` must be None. What fails is raised, and leaves
        prompt passes eager for good (``failed``)."""
        with self._failing():
            self._check_still_valid()
            size = prompt_bucket(len(batch.tokens), self.buckets[-1])
            entry = self._graphs.get(size)
            if entry is None:
                entry = self._capture(size)
            for name, value in self._inputs(batch, size).items():
                entry.inputs[name].copy_(_staged(value, entry.inputs[name]), non_blocking=True)
            entry.graph.replay()
        account(self.experts, entry, len(batch.tokens), size)
        return entry.out[:len(batch)].clone()

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (a server's start: no capture while it serves); logs the time."""
        start = time.perf_counter()
        with self._failing():
            self._check_still_valid()
            for size in sorted(self.buckets, reverse=True):
                if size not in self._graphs:
                    self._capture(size)
            torch.cuda.synchronize(self.device)
        log.info("cuda graphs: prompt passes of %s tokens captured in %.2f s", ", ".join(map(str, self.buckets)),
                 time.perf_counter() - start)

    # --- inputs and capture ------------------------------------------------------------------------

    def _inputs(self, batch: PromptBatch, size: int) -> dict[str, torch.Tensor]:
        """The static inputs of ``batch`` padded to ``size`` tokens (the KV row ids already on the device)."""
        n, pad = len(batch.tokens), size - len(batch.tokens)
        ends = torch.tensor(batch.lengths, dtype=torch.int32).cumsum(0)  # [S]
        absent = self.max_sessions - len(batch)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), ends, torch.full((absent,), n, dtype=torch.int32),
                        torch.tensor([size], dtype=torch.int32)])  # [max_sessions + 2]
        last = torch.cat([(ends - 1).long(), torch.zeros(absent, dtype=torch.int64)])  # [max_sessions]
        positions = torch.cat([*map(torch.arange, batch.lengths), torch.zeros(pad, dtype=torch.int64)])
        rows = [s.kv.paged(self.layers.start, length, "k")[-1] for s, length in zip(batch.sessions, batch.lengths)]
        rows.append(self._padding_row().expand(pad))
        return {"tokens": torch.cat([batch.tokens, batch.tokens.new_zeros(pad)]), "positions": positions,
                "kv_rows": torch.cat(rows), "cu_seqlens": cu, "last_rows": last,
                "live": self.padding.live_pairs(n)}

    def _padding_row(self) -> torch.Tensor:
        """int64 ``[1]`` on the device: the padding session's first KV row (its one block is reserved)."""
        return self.padding.session.kv.paged(self.layers.start, 1, "k")[-1]

    def _empty_inputs(self, size: int) -> dict[str, torch.Tensor]:
        """The inputs of a pass of padding rows alone (what a capture runs)."""
        return {"tokens": torch.zeros(size, dtype=torch.int64), "positions": torch.zeros(size, dtype=torch.int64),
                "kv_rows": self._padding_row().repeat(size),
                "cu_seqlens": torch.tensor([0] * (self.max_sessions + 1) + [size], dtype=torch.int32),
                "last_rows": torch.zeros(self.max_sessions, dtype=torch.int64), "live": self.padding.live_pairs(0)}

    def _body(self, size: int) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        model, rows = self.model, self.experts.rows_for(self.slot, "prompt")

        def body(static: dict[str, torch.Tensor]) -> torch.Tensor:
            packed = PackedKV(self.padding.session.kv, static["kv_rows"], static["cu_seqlens"], size)
            hidden = model.embed(static["tokens"])  # [size, H]
            with self.padding.counting(rows, static["live"]):
                for layer in self.layers:
                    hidden = model.moe(layer, model.attention_packed(layer, hidden, static["positions"], packed), rows)
            return model.head(hidden[static["last_rows"]]).float()  # [max_sessions, vocab]

        return body

    def _capture(self, size: int) -> _Graph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        start = time.perf_counter()
        entry = capture_graph(self.experts, self.layers, self._body(size), self._empty_inputs(size), 2, self._stream,
                              pool=self._pool)
        self._graphs[size] = entry
        log.debug("cuda graphs: captured a prompt pass of %d tokens in %.2f s", size, time.perf_counter() - start)
        return entry

    @contextmanager
    def _failing(self) -> Iterator[None]:
        """What the block raises marks the graphs failed (prompt passes run eagerly from then on) and drops them."""
        try:
            yield
        except Exception as exc:
            self.failed = f"a prompt graph failed ({type(exc).__name__}: {exc})"
            self._drop()
            raise

    def _drop(self) -> None:
        """Drop every graph and their memory pool: the pool goes with its last graph, so a later capture takes a
        new one (capturing into the released pool's handle fails an assertion of torch's allocator)."""
        self._graphs.clear()
        self._pool = None

    def _check_still_valid(self) -> None:
        """Drop the graphs when a cache's residency changed since they were captured (they read its slots), or
        a decode graph was captured after them (the module's docstring)."""
        state = (tuple(table.version for table in self.experts.tables.values()), self.decode_captures())
        if state != self._captured_after:
            if self._graphs:
                log.info("cuda graphs: prompt graphs dropped (%s since their capture)",
                         "a decode graph captured" if self._captured_after and state[0] == self._captured_after[0]
                         else "the expert residency changed")
            self._drop()
            self._captured_after = state
