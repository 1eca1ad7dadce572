"""``--cuda-graphs``: a decode window's segments captured once as CUDA graphs and replayed.

Decode is host-bound (BENCHMARKS.md: ~200 ms of host per token while the GPU is busy ~56 ms); a
replayed graph launches a whole segment (a device slot's contiguous layers of the decode placement)
with one call, so a placement over several devices gets one graph per segment. What is captured is
the layers of ``Engine.decode_segment`` (attention + MoE of every layer of the segment), never a
hook: the strategy's ``strata_decode_window`` (and every observer wrapping it) runs as before,
embeds the tokens and runs the head around the replays; only ``Engine.run_decode`` (the default
window of a placement with one decode segment) replays the embedding and head inside the graph
too (``decode_step``, below).

Where the shapes allow, and only there: the segment on a CUDA device, the decode gather on for
every layer of it (it has no host read: ``--arena pinned`` with every layer pinned, ``--pcie-frac 1``,
Triton, an own cache in every layer and no peer read across: a computing peer's work rides in the graph,
experts/peer.py), no ``--adapt-swaps`` (it changes the cache between windows on a copy stream) and no layer observers
(``--dbg-nan`` reads each layer on the host). Anywhere else the window runs eagerly and the reason
is logged once.

Static shapes: the captured body attends over the whole KV capacity, masked on the device from the
positions (``MoEModel.attention(static=True)``, what the CPU path always does); the hidden input
and the positions are static device buffers refilled before each replay (a device copy, and a
non-blocking copy from pinned host memory); the output stays in the graph's pool and is returned as
a clone. A graph reads and writes the KV tensors of the sessions it was captured with, so it is
cached per (B, layers, session ids) together with the addresses of those tensors: a released
session (its tensors dropped), a moved one (new tensors) or a new set of sessions captures again;
truncating or restoring a session keeps its tensors, so its graph stays valid. At most
``max_graphs`` graphs are kept (least recently used first out); dead sessions' graphs are purged.

Where the segment's layers take the fused decode path (model/fused_decode.py: the plain Qwen-style
model on CUDA) the graph is *shared*: the kernels reach each session's KV through an address table
(``[layers, B, 2]``), a static buffer refilled from pinned memory before each replay, so the cache
key is (B, layers) alone and a new session replays the graph captured for another. With a single
decode segment on the main device the whole window is one graph (``decode_step``: embedding,
layers, head; ``Engine.run_decode``), one per batch size; the output is the float32 logits.

Telemetry inside the graph (``ExpertTelemetry.capturing``): no CUDA timing events (copy/compute
seconds are not measured for replayed windows, so the bench's link GB/s reads 0); the gather's
device counters are in-place adds into graph-owned tensors that each replay recomputes, folded into
the telemetry after the replay (one device add, no host read); the host-side counters a window
bumps (routed pairs, tokens of the usage profile) are measured once at capture and added per
replay; the routing counts of the usage profile are in-place ``index_add_`` on their own tensor.

Capture: the first graph of a (B, layers) is preceded by ``warmup`` eager windows on a side stream
(lazy initialisation, Triton compilation; torch.cuda.graphs' advice). They rewrite the same KV rows
with the same values; a recurrent state they advance is put back; their telemetry is discarded. Capturing synchronises the device once per
new set of sessions; a replay does not synchronise.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from strata_core.runtime.devices import to_device
from strata_core.model.fused_decode import fused_reason, kv_tables

if TYPE_CHECKING:
    from strata_core.engine import Engine
    from strata_core.plugin.placement import Segment
    from strata_core.runtime.session import DecodeBatch, Session

__all__ = ["DecodeGraphs"]

log = logging.getLogger(__name__)

Key = tuple[int, int, int, int, tuple[int, ...], bool]  # (B, device slot, first, stop layer, session ids, whole step)


@dataclass
class _Graph:
    """One captured window: the graph and the static tensors it reads and writes."""

    graph: Any  # torch.cuda.CUDAGraph (or a test fake with replay())
    hidden: torch.Tensor | None  # [B, H] static input (None: a whole-step graph embeds ``tokens``)
    positions: torch.Tensor  # [B] int64 static input
    out: torch.Tensor  # [B, H] static output (in the graph's pool)
    sink: dict = field(default_factory=dict)  # (counter names, device) -> int64 counts of one replay
    host_delta: dict[str, int] = field(default_factory=dict)  # host counters one window adds
    signature: tuple = ()
    sessions: tuple[weakref.ref, ...] = ()
    tables: torch.Tensor | None = None  # [layers, B, 2] static KV address tables (session-independent graphs)
    tokens: torch.Tensor | None = None  # [B] static token ids (a whole-step graph: embedding to logits)


class DecodeGraphs:
    """The CUDA graphs of one engine's decode segments, keyed by (B, segment, session ids); called
    with the segment's device current (``Engine.decode_segment``), where it captures and replays.

    ``decode_segment(segment, hidden, batch)`` replays (capturing first where needed) and returns the
    segment's output ``[B, H]``, or None when it must run eagerly (the reason is logged once).
    """

    def __init__(self, engine: Engine, max_graphs: int = 4, warmup: int = 2):
        self.engine, self.max_graphs, self.warmup = engine, max_graphs, warmup
        self._graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self._warm: set[tuple[int, int, int, int, bool]] = set()
        self._said: set[str] = set()
        self.failed: str | None = None  # a capture failed: eager from then on
        self.captures = 0
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}

    # --- where graphs apply ----------------------------------------------------------------------

    def why_not(self, segment: Segment, batch: DecodeBatch) -> str | None:
        """Why this segment cannot be replayed as a graph, or None when it can."""
        engine = self.engine
        if self.failed is not None:
            return self.failed
        slot = engine.devices[segment.device]
        if slot.device.type != "cuda":
            return f"the decode runs on {slot}, not a CUDA device"
        rows = engine.experts.rows_for(segment.device, "decode")
        if not (rows.gather and rows.decoding):
            return (f"the decode gather is off on {slot} (it needs --arena pinned with every layer "
                    "pinned, --pcie-frac 1 and Triton)")
        if any(rows.chains[layer].own is None or not all(map(rows.chains[layer].computes, rows.chains[layer].peers))
               for layer in segment.layers):  # a peer computing its rows is on events only (experts/peer.py)
            return f"a layer of {slot} reads a peer's cache across or has no cache of its own"
        if engine.settings.adapt_swaps or any(engine.placement.adapt_swaps.values()):
            return "--adapt-swaps changes the expert cache between windows"
        if engine.layer_observers:
            return "layer observers (e.g. --dbg-nan) run host code after each layer"
        return None

    def _say(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.info("cuda graphs: decode runs eagerly: %s", reason)

    # --- the cache -------------------------------------------------------------------------------

    def shared(self, segment: Segment) -> bool:
        """Whether a graph of ``segment`` serves any sessions: its layers take the fused path, which
        reaches the KV through address tables refilled before each replay (model/fused_decode.py)."""
        return fused_reason(self.engine.model, self.engine.devices[segment.device].device) is None

    @staticmethod
    def key(segment: Segment, batch: DecodeBatch, shared: bool = False, step: bool = False) -> Key:
        layers = segment.layers
        ids = () if shared else tuple(s.id for s in batch.sessions)
        return (len(batch.sessions), segment.device, layers.start, layers.stop, ids, step)

    @staticmethod
    def signature(layers: range, sessions: tuple[Session, ...]) -> tuple | None:
        """Addresses of the state tensors a graph of ``sessions`` reads and writes; None if released."""
        out = []
        for session in sessions:
            kv = session.kv
            try:
                out.append((kv.max_tokens, *(t.data_ptr() for i in layers for t in kv.tensors[i].values())))
            except KeyError:
                return None
        return tuple(out)

    def invalidate(self, session: Session | None = None) -> None:
        """Drop the graphs of ``session`` (every graph if None)."""
        for key in [k for k in self._graphs if session is None or session.id in k[4]]:  # shared ones stay
            del self._graphs[key]

    def _purge(self) -> None:
        """Drop graphs whose sessions are gone or released."""
        for key, entry in list(self._graphs.items()):
            alive = [ref() for ref in entry.sessions]
            if any(s is None or not s.kv.tensors for s in alive):
                del self._graphs[key]

    def entry(self, segment: Segment, batch: DecodeBatch, hidden: torch.Tensor | None, shared: bool = False,
              step: bool = False) -> _Graph:
        """The graph of this segment's window (of the whole step with ``step``): the cached one if still
        valid, else a new capture. A ``shared`` graph is valid for any sessions."""
        self._purge()
        key = self.key(segment, batch, shared, step)
        sig = () if shared else self.signature(segment.layers, batch.sessions)
        entry = self._graphs.get(key)
        if entry is not None and entry.signature == sig:
            self._graphs.move_to_end(key)
            return entry
        self._graphs.pop(key, None)
        entry = self._capture(segment, batch, hidden, shared, step)
        self.captures += 1
        entry.signature = sig
        entry.sessions = () if shared else tuple(weakref.ref(s) for s in batch.sessions)
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry

    def __len__(self) -> int:
        return len(self._graphs)

    # --- replay ----------------------------------------------------------------------------------

    def decode_segment(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch) -> torch.Tensor | None:
        """``[B, H]`` after ``segment`` by graph replay, or None: run it eagerly."""
        reason = self.why_not(segment, batch)
        if reason is not None:
            self._say(reason)
            return None
        entry = self._entry_or_none(segment, batch, hidden, self.shared(segment))
        if entry is None:
            return None
        entry.hidden.copy_(hidden)
        return self._replay(entry, segment, batch)

    def decode_step(self, segment: Segment, batch: DecodeBatch) -> torch.Tensor | None:
        """Float32 logits ``[B, V]`` of the whole window (embedding, ``segment``: the decode placement's
        only one, head) by one graph replay, or None: run it the other way (the reason is logged once)."""
        engine = self.engine
        if self.why_not(segment, batch) is not None:
            return None  # no graph at all: the segment path says why
        reason = fused_reason(engine.model, engine.main.device)
        if engine.devices[segment.device].device != engine.main.device:
            reason = "the embedding and head live on another device than the decode layers"
        if reason is not None:
            self._say(f"no whole-step graph: {reason}")
            return None
        entry = self._entry_or_none(segment, batch, None, True, step=True)
        if entry is None:
            return None
        entry.tokens.copy_(batch.tokens.pin_memory(), non_blocking=True)
        return self._replay(entry, segment, batch)

    def _entry_or_none(self, segment: Segment, batch: DecodeBatch, hidden: torch.Tensor | None, shared: bool,
                       step: bool = False) -> _Graph | None:
        try:
            return self.entry(segment, batch, hidden, shared, step)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager for good
            self.failed = f"capture failed ({type(exc).__name__}: {exc})"
            log.warning("cuda graphs: %s; decode runs eagerly from now on", self.failed)
            self._graphs.clear()
            return None

    def _replay(self, entry: _Graph, segment: Segment, batch: DecodeBatch) -> torch.Tensor:
        """Refill the static inputs (positions, the KV address tables), replay, account; the output's copy."""
        entry.positions.copy_(batch.positions.pin_memory(), non_blocking=True)
        if entry.tables is not None:
            entry.tables.copy_(kv_tables(batch.sessions, segment.layers).pin_memory(), non_blocking=True)
        entry.graph.replay()
        self._account(entry)
        return entry.out.clone()

    def _account(self, entry: _Graph) -> None:
        """Fold one replay's counters into the telemetry (device adds, no host read)."""
        telemetry = self.engine.telemetry
        for (names, _), counts in entry.sink.items():
            telemetry.add_counts(names, counts.clone())
        _add_host(self.engine, entry.host_delta)

    # --- capture ---------------------------------------------------------------------------------

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """A capture stream of ``device``. ``torch.cuda.graph``'s default is one stream for the whole
        process, made on the device current at its first use: a second GPU's segment captured on it
        ran with the first GPU current and the capture failed (cudaErrorStreamCaptureInvalidated)."""
        if device not in self._capture_streams:
            self._capture_streams[device] = torch.cuda.Stream(device)
        return self._capture_streams[device]

    def _capture(self, segment: Segment, batch: DecodeBatch, hidden: torch.Tensor | None, shared: bool = False,
                 step: bool = False) -> _Graph:
        engine, layers = self.engine, segment.layers
        device = engine.devices[segment.device].device
        static_hidden = hidden.clone() if hidden is not None else None
        static_positions = torch.empty(len(batch), dtype=torch.int64, device=device)
        static_positions.copy_(batch.positions.pin_memory(), non_blocking=True)
        tables = to_device(kv_tables(batch.sessions, layers), device) if shared else None
        tokens = to_device(batch.tokens, device) if step else None
        caches = engine.experts.caches.values()
        for cache in caches:  # swaps still landing: wait now, not inside the capture
            for layer in layers:
                cache.wait_layer(layer, device)
        usages = engine.experts.usages()
        host_before = _read_host(engine)
        counts_before = [u.counts.clone() for u in usages]

        def body() -> torch.Tensor:
            if step:
                h = engine.model.embed(tokens)  # [B, H]
                return engine.model.head(engine._decode_layers(segment, h, batch, static_positions, tables)).float()
            if tables is not None:
                return engine._decode_layers(segment, static_hidden, batch, static_positions, tables)
            return engine.decode_segment(segment, static_hidden, batch, static_positions=static_positions)

        sink: dict = {}
        try:
            warm = (len(batch), segment.device, layers.start, layers.stop, step)
            if warm not in self._warm:
                # a recurrent state (Gated DeltaNet) would advance once per warm-up window: kept aside
                states = [t for s in batch.sessions for i in layers for t in s.kv.recurrent(i).values()]
                kept = [t.clone() for t in states]
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with engine.telemetry.capturing({}), torch.cuda.stream(side):
                    for _ in range(self.warmup):
                        body()
                torch.cuda.current_stream(device).wait_stream(side)
                for state, copy in zip(states, kept):
                    state.copy_(copy)
                for usage, counts in zip(usages, counts_before):
                    usage.counts.copy_(counts)  # the warm-up's routings are not usage
                self._warm.add(warm)
            host_mid = _read_host(engine)
            graph = torch.cuda.CUDAGraph()
            with engine.telemetry.capturing(sink), torch.cuda.graph(graph, stream=self._capture_stream(device)):
                out = body()
            delta = {k: v - host_mid[k] for k, v in _read_host(engine).items()}
        finally:
            _write_host(engine, host_before)
        log.info("cuda graphs: captured a decode %s of %d session(s) over %s layers %d..%d%s",
                 "step (embedding to logits)" if step else "window", len(batch), engine.devices[segment.device],
                 layers.start, layers.stop - 1, ", for any sessions" if shared else "")
        return _Graph(graph, static_hidden, static_positions, out, sink, delta, tables=tables, tokens=tokens)


# --- host-side counters a window bumps (measured at capture, added per replay) ---------------------

def _read_host(engine: Engine) -> dict[str, int]:
    t = engine.telemetry
    out = {"routed": t.routed, "bytes_copied": t.bytes_copied, "swaps": t.swaps}
    out.update({f"experts.{k}": v for k, v in t.experts.items()})
    out.update({f"usage.{i}": u.tokens for i, u in enumerate(engine.experts.usages())})
    return out


def _write_host(engine: Engine, values: dict[str, int]) -> None:
    t, usages = engine.telemetry, engine.experts.usages()
    for name, value in values.items():
        if name.startswith("experts."):
            t.experts[name.split(".", 1)[1]] = value
        elif name.startswith("usage."):
            usages[int(name.split(".", 1)[1])].tokens = value
        else:
            setattr(t, name, value)


def _add_host(engine: Engine, delta: dict[str, int]) -> None:
    current = _read_host(engine)
    _write_host(engine, {k: current[k] + v for k, v in delta.items() if v})
