"""``--cuda-graphs``: decode windows captured once as CUDA graphs and replayed.

Decode is host-bound: a replayed graph launches a whole segment (a device slot's contiguous layers
of the decode placement), or a whole window (embedding, layers, head), with one call. This module
is the capture cache only: the runner (runtime/runner.py) decides where graphs apply and hands
over the *body* to capture (a callable reading its static inputs) with the window's fresh values
of those inputs; a phase hook never runs inside a graph.

Static shapes: the captured body attends over the whole KV capacity, masked on the device from the
positions; its inputs (hidden state, positions, token ids, the rows' KV address or block tables) are static
device buffers refilled before each replay (a device copy, or a non-blocking copy from pinned host memory);
the output stays in the graph's pool and is returned as a clone. No graph reads a session's KV at an address
of its own (the fused kernels follow address tables, the unfused layers run on stand-ins: stand_ins.py), so a
graph is keyed by (B, layers, whole step) alone and serves any sessions. At most ``max_graphs`` graphs are
kept (least recently used first out).

Telemetry inside the graph (``ExpertTelemetry.capturing``): no CUDA timing events (copy/compute
seconds are not measured for replayed windows); the gather's device counters are in-place adds
into graph-owned tensors that each replay recomputes, folded into the telemetry after the replay
(one device add, no host read); the host-side counters a window bumps (routed pairs, tokens of the
usage profile) are measured once at capture and added per replay.

Batch buckets: the runner pads a window to the next of :data:`BUCKETS` (``bucket``) with rows of a
padding session, so one graph of a bucket serves every window of 5 to 8 sessions, say: a server's
sessions joining and leaving never capture again (``Runner.capture_buckets`` captures them at start).
The padded rows are computed and not counted: the gather counts only the first ``live`` pairs (a
static input), and the host counters measured at capture (proportional to the rows) are added per
replay for the live rows only (``replay(..., live=n)``).

Capture: the first graph of a (B, layers) is preceded by ``warmup`` eager windows on a side stream
(lazy initialisation, Triton compilation; torch.cuda.graphs' advice). They rewrite the same KV rows
with the same values; a recurrent state they advance is put back; their telemetry is discarded.
Capturing synchronises the device once per new key; a replay does not synchronise.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from strata_core.experts.backend import ExpertBackend
    from strata_core.plugin.placement import Segment
    from strata_core.runtime.session import DecodeBatch

__all__ = ["BUCKETS", "Body", "DecodeGraphs", "account", "bucket", "capture_graph"]

log = logging.getLogger(__name__)

Key = tuple[int, int, int, int, bool]  # (B, device slot, first, stop layer, whole step)
#: what a graph captures: reads its static inputs (by name), returns the window's output
Body = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class _Graph:
    """One captured window: the graph and the static tensors it reads and writes."""

    graph: Any  # torch.cuda.CUDAGraph (or a test fake with replay())
    inputs: dict[str, torch.Tensor]  # static inputs, refilled before each replay
    out: torch.Tensor  # static output (in the graph's pool)
    sink: dict = field(default_factory=dict)  # (counter names, device) -> int64 counts of one replay
    host_delta: dict[str, int] = field(default_factory=dict)  # host counters one window adds


#: the batch sizes decode windows are captured at (a larger window: the next multiple of the last)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The batch size a window of ``n`` sessions is padded to: the smallest of :data:`BUCKETS` that holds it."""
    if n < 1:
        raise ValueError(f"a decode window has at least one session, got {n}")
    last = BUCKETS[-1]
    return next((b for b in BUCKETS if b >= n), -(-n // last) * last)


def _staged(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``value`` ready for a non-blocking copy into ``target``: pinned when it goes from the host to a device."""
    return value.pin_memory() if value.device.type == "cpu" and target.device.type != "cpu" else value


class DecodeGraphs:
    """The CUDA graphs of one engine's decode windows, keyed by (B, segment, whole step);
    called with the segment's device current, where it captures and replays.

    :param experts: the expert backend whose telemetry and usage counters a replay accounts for
        (None in tests of the cache alone).
    """

    def __init__(self, experts: ExpertBackend | None, max_graphs: int = 4, warmup: int = 2):
        self.experts, self.max_graphs, self.warmup = experts, max_graphs, warmup
        self._graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self._warm: set[tuple[int, int, int, int, bool]] = set()
        self.failed: str | None = None  # a capture failed: eager from then on
        self.captures = 0
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}

    # --- the cache -------------------------------------------------------------------------------

    @staticmethod
    def key(segment: Segment, batch: DecodeBatch, step: bool = False) -> Key:
        """The cache key of ``segment``'s window over ``batch``."""
        layers = segment.layers
        return (len(batch.sessions), segment.device, layers.start, layers.stop, step)

    def invalidate(self) -> None:
        """Drop every graph (captured again at the next window)."""
        self._graphs.clear()

    def entry(self, segment: Segment, batch: DecodeBatch, inputs: dict[str, torch.Tensor], body: Body | None,
              step: bool = False) -> _Graph:
        """The graph of this window: the cached one, else a capture of ``body`` over static copies of ``inputs``."""
        key = self.key(segment, batch, step)
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            return entry
        entry = self._capture(segment, batch, inputs, body, step)
        self.captures += 1
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry

    def __len__(self) -> int:
        return len(self._graphs)

    # --- replay ----------------------------------------------------------------------------------

    def replay(self, segment: Segment, batch: DecodeBatch, inputs: dict[str, torch.Tensor], body: Body,
               step: bool = False, live: int | None = None) -> torch.Tensor | None:
        """The window's output by graph replay (capturing first where needed), or None when a capture
        failed: the caller runs it eagerly, from then on. ``live``: how many of the batch's rows are real
        (the rest pad it to its bucket; None: all)."""
        if self.failed is not None:
            return None
        try:
            entry = self.entry(segment, batch, inputs, body, step)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager for good
            self.failed = f"capture failed ({type(exc).__name__}: {exc})"
            log.warning("cuda graphs: %s; decode runs eagerly from now on", self.failed)
            self._graphs.clear()
            return None
        for name, value in inputs.items():
            entry.inputs[name].copy_(_staged(value, entry.inputs[name]), non_blocking=True)
        entry.graph.replay()
        account(self.experts, entry, len(batch) if live is None else live, len(batch))
        return entry.out.clone()

    # --- capture ---------------------------------------------------------------------------------

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """A capture stream of ``device``. ``torch.cuda.graph``'s default is one stream for the whole
        process, made on the device current at its first use: a second GPU's segment captured on it
        ran with the first GPU current and the capture failed (cudaErrorStreamCaptureInvalidated)."""
        if device not in self._capture_streams:
            self._capture_streams[device] = torch.cuda.Stream(device)
        return self._capture_streams[device]

    def _capture(self, segment: Segment, batch: DecodeBatch, inputs: dict[str, torch.Tensor], body: Body,
                 step: bool) -> _Graph:
        device = torch.device("cuda", torch.cuda.current_device())
        layers = segment.layers
        warm = (len(batch), segment.device, layers.start, layers.stop, step)
        # a recurrent state (Gated DeltaNet) would advance once per warm-up window: kept aside
        states = [t for s in batch.sessions for i in layers for t in s.kv.recurrent(i).values()]
        entry = capture_graph(self.experts, layers, body, inputs, self.warmup if warm not in self._warm else 0,
                              self._capture_stream(device), states)
        self._warm.add(warm)
        log.info("cuda graphs: captured a decode %s of %d session(s) over slot %d layers %d..%d",
                 "step (embedding to logits)" if step else "window", len(batch), segment.device,
                 layers.start, layers.stop - 1)
        return entry


def capture_graph(experts: ExpertBackend, layers: range, body: Body, inputs: dict[str, torch.Tensor], warmup: int,
                  stream: torch.cuda.Stream, states: Sequence[torch.Tensor] = (), pool: Any = None) -> _Graph:
    """Capture ``body`` over static copies of ``inputs`` on the current CUDA device (on ``stream``, into the
    memory pool ``pool`` where given), after ``warmup`` eager runs of it on a side stream (lazy initialisation,
    Triton compilation) whose effects on the usage counts and on ``states`` (tensors they would advance) are
    put back. The telemetry's device counters of one replay go to the graph's sink, its host counters' change
    to ``host_delta`` (both folded in per replay: ``account``)."""
    device = torch.device("cuda", torch.cuda.current_device())
    static = {}
    for name, value in inputs.items():
        static[name] = torch.empty_like(value, device=device)
        static[name].copy_(_staged(value, static[name]), non_blocking=True)
    for cache in experts.caches.values():  # swaps still landing: wait now, not inside the capture
        for layer in layers:
            cache.wait_layer(layer, device)
    usages = experts.usages()
    host_before = _read_host(experts)
    counts_before = [u.counts.clone() for u in usages]
    sink: dict = {}
    try:
        if warmup:
            kept = [t.clone() for t in states]
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with experts.telemetry.capturing({}), torch.cuda.stream(side):
                for _ in range(warmup):
                    body(static)
            torch.cuda.current_stream(device).wait_stream(side)
            for state, copy in zip(states, kept):
                state.copy_(copy)
            for usage, counts in zip(usages, counts_before):
                usage.counts.copy_(counts)  # the warm-up's routings are not usage
        host_mid = _read_host(experts)
        graph = torch.cuda.CUDAGraph()
        with experts.telemetry.capturing(sink), torch.cuda.graph(graph, pool=pool, stream=stream):
            out = body(static)
        delta = {k: v - host_mid[k] for k, v in _read_host(experts).items()}
    finally:
        _write_host(experts, host_before)
    return _Graph(graph, static, out, sink, delta)


def account(experts: ExpertBackend, entry: _Graph, live: int, rows: int) -> None:
    """Fold one replay of ``entry``'s counters into the telemetry (device adds, no host read); the host
    counters, measured for the graph's ``rows`` rows, for its ``live`` rows."""
    telemetry = experts.telemetry
    for (names, _), counts in entry.sink.items():
        telemetry.add_counts(names, counts.clone())
    _add_host(experts, {name: value * live // rows for name, value in entry.host_delta.items()})


# --- host-side counters a window bumps (measured at capture, added per replay) ---------------------

def _read_host(experts: ExpertBackend) -> dict[str, int]:
    t = experts.telemetry
    out = {"routed": t.routed, "bytes_copied": t.bytes_copied, "swaps": t.swaps}
    out.update({f"experts.{k}": v for k, v in t.experts.items()})
    out.update({f"usage.{i}": u.tokens for i, u in enumerate(experts.usages())})
    return out


def _write_host(experts: ExpertBackend, values: dict[str, int]) -> None:
    t, usages = experts.telemetry, experts.usages()
    for name, value in values.items():
        if name.startswith("experts."):
            t.experts[name.split(".", 1)[1]] = value
        elif name.startswith("usage."):
            usages[int(name.split(".", 1)[1])].tokens = value
        else:
            setattr(t, name, value)


def _add_host(experts: ExpertBackend, delta: dict[str, int]) -> None:
    current = _read_host(experts)
    _write_host(experts, {k: current[k] + v for k, v in delta.items() if v})
