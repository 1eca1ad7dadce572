"""Runner: a loaded model's phases under a placement.

The runner owns what runs between the engine's public calls and the kernels: the embedding and the
head on the main device, the segments of each phase, the one prompt layer loop and the one decode
layer loop (run eagerly, or captured as a CUDA graph and replayed: runtime/graph_replays.py, the runner's
CUDA-graph half; ``--batch-invariant``: runtime/invariance.py), and the phase
state around a phase (residency masking in place, the hand-off of per-layer state:
runtime/phase_state.py). A phase is a hook (``strata_prefill`` per prompt batch,
``strata_decode_window`` per window) whose ``ctx`` is this runner seen as the plugin contract's
:class:`~strata_core.plugin.context.PhaseContext`; the core's answers are :meth:`Runner.run_prompt`
and :meth:`Runner.run_decode`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pluggy
import torch

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.experts.backend import ExpertBackend
from strata_core.experts.telemetry import ExpertTelemetry
from strata_core.model.fused_decode import decode_layer as fused_decode_layer
from strata_core.model.fused_decode import kv_tables, why_not_fused
from strata_core.model.transformer import MoEModel
from strata_core.plugin.context import LayerObserver, PhaseContext, StageTime
from strata_core.plugin.events import ResidencyEvent
from strata_core.plugin.placement import PHASES, DeviceSlot, Phase, Placement, Segment
from strata_core.plugin.spec import StrategyOptions
from strata_core.remote.stages import RemoteStages
from strata_core.runtime.devices import device_scope, to_device
from strata_core.runtime.buckets import BatchPadding
from strata_core.runtime.graph_replays import GraphReplays
from strata_core.runtime.graphs import DecodeGraphs
from strata_core.runtime.invariance import decode_launches
from strata_core.runtime.phase_state import hidden_layers, masked_phase, place_state
from strata_core.runtime.prompt_graphs import PromptGraphs
from strata_core.runtime.session import UNSET, DecodeBatch, LogitsWanted, PromptBatch, Session
from strata_core.runtime.stand_ins import StandIns

__all__ = ["HiddenSink", "Runner"]

log = logging.getLogger(__name__)

#: receives a session's rows of the last layer's output (before the output norm) after a prompt pass or a
#: decode window: ``(session, position of the first row, hidden [n, H])``
HiddenSink = Callable[[Session, int, torch.Tensor], None]


class Runner(GraphReplays):
    """Runs prompt chunks and decode windows of one loaded model under its placement.

    :param hook: the plugin manager's hook relay (phase hooks, residency events, hand-offs).
    :param padding_session: makes the session whose rows pad a graphed decode window to its bucket
        (one position, every layer at home in the decode placement).
    :param remote: rank 0's sender of the segments on other ranks (strata_core/remote/), None in one process.
    """

    def __init__(self, settings: StrataSettings, hook: pluggy.HookRelay, options: StrategyOptions,
                 devices: tuple[DeviceSlot, ...], placement: Placement, model: MoEModel,
                 experts: ExpertBackend, padding_session: Callable[[], Session],
                 remote: RemoteStages | None = None) -> None:
        self.settings = settings
        self.options = options
        self.devices = devices
        self.placement = placement
        self.main = devices[placement.main]
        self.model = model
        self.experts = experts
        #: what the phase hooks receive as ``ctx`` (the testing kit swaps in a strict view of it)
        self.context: PhaseContext = self
        self._hook = hook
        self._segments = {phase: placement.segments(phase) for phase in PHASES}
        self._remote = remote
        self._hidden = hidden_layers(placement, {slot: layers for slot, layers in placement.cached_layers().items()
                                                 if slot in experts.tables})  # this process's caches
        self._observers: list[LayerObserver] = []
        self._stage_times: list[StageTime] | None = None
        self._graphs: DecodeGraphs | None = None
        self._prompt_graphs: PromptGraphs | None = None
        self._stand_ins: dict[tuple[int, int, int], StandIns] = {}  # (slot, first, stop layer) -> its stand-ins
        self._said: set[str] = set()
        self._fused: dict[torch.device, bool] = {}
        self._padding = BatchPadding(padding_session, model.spec.n_experts_used)
        #: given every pass's hidden rows by session (MTP drafting reads them); None: they are not kept
        self.hidden_sink: HiddenSink | None = None
        self._pass_hidden: torch.Tensor | None = None  # the rows of the pass in progress, while a sink is set

    # --- phases, as the engine runs them ----------------------------------------------------------

    def announce(self, event: ResidencyEvent) -> None:
        """Tell every plugin of a residency change (``strata_residency``)."""
        self._hook.strata_residency(ctx=self.context, event=event)

    def plan_residency(self) -> None:
        """Announce each cache's initial fill (``plan``), once the engine has loaded."""
        for slot in self.experts.tables:
            self.announce(ResidencyEvent("plan", self.devices[slot]))

    def _place(self, session: Session, phase: Phase) -> None:
        place_state(session, self.placement, phase, self.devices, self._hand_off, self.settings.dbg_handoff)

    def _hand_off(self, session: Session, layers: range, src: DeviceSlot, dst: DeviceSlot) -> bool | None:
        """One hand-off: between ranks over the cluster's channel (a plugin's ``strata_hand_off`` moves
        state within a process only), else the hook."""
        if src.rank != dst.rank:
            if self._remote is None:
                raise ConfigError(f"a hand-off from {src} to {dst} needs the other ranks (this engine runs alone)")
            self._remote.hand_off(session, layers, src, dst)
            return True
        return self._hook.strata_hand_off(ctx=self.context, session=session, layers=layers, src=src, dst=dst)

    def _masked(self, phase: Phase):
        return masked_phase(self.experts.tables, self._hidden[phase], self.announce, self.devices)

    def prefill(self, session: Session, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """Extend ``session`` by int64 ``tokens [T]`` in chunks of ``--prefill-chunk``, one
        ``strata_prefill`` a chunk under the prompt placement, each committed after its hook.

        :return: float32 logits ``[T, vocab]`` with ``all_logits``, else ``[1, vocab]`` of the last position.
        """
        outputs = []
        chunk = self.settings.prefill_chunk
        self._place(session, "prompt")
        with self._masked("prompt"):
            for start in range(0, len(tokens), chunk):
                piece = tokens[start:start + chunk]
                last = start + chunk >= len(tokens)
                want: LogitsWanted = "all" if all_logits else "last" if last else "none"
                logits = self._prompt_pass(PromptBatch.of([(session, piece)]), want)
                if want != "none":
                    outputs.append(logits)
        self._place(session, "decode")
        return torch.cat(outputs)

    def prefill_batch(self, chunks: list[tuple[Session, torch.Tensor]]) -> torch.Tensor:
        """Extend each session by its chunk (int64 ``[n]``; together at most ``--prefill-chunk``
        tokens) in one ``strata_prefill``, committed after it; float32 logits ``[len(chunks), vocab]``
        of each chunk's last position."""
        batch = PromptBatch.of(chunks)
        for session in batch.sessions:
            self._place(session, "prompt")
        with self._masked("prompt"):
            logits = self._prompt_pass(batch, "last")
        for session in batch.sessions:
            self._place(session, "decode")
        return logits

    def _prompt_pass(self, batch: PromptBatch, want: LogitsWanted) -> torch.Tensor:
        first = [session.n_tokens for session in batch.sessions]
        self._pass_hidden = None
        logits = self._hook.strata_prefill(ctx=self.context, batch=batch, logits=want)
        for session, start, end in batch.spans:
            session.kv.advance(end - start)
            session.tokens.extend(batch.tokens[start:end].tolist())
        self._sink([(session, position, start, end) for (session, start, end), position in zip(batch.spans, first)])
        return logits

    def _sink(self, spans: Sequence[tuple[Session, int, int, int]]) -> None:
        """Hand the pass's hidden rows to the sink, if one is set: ``(session, position of its first row,
        its rows [start, end))`` each."""
        hidden, self._pass_hidden = self._pass_hidden, None
        if self.hidden_sink is not None and hidden is not None:
            for session, position, start, end in spans:
                self.hidden_sink(session, position, hidden[start:end])

    @contextmanager
    def _decode_phase(self) -> Iterator[None]:
        """The block is one decode window of the expert caches, under the decode masking; the caches
        adapt after it unless it raised."""
        self.experts.begin_window()
        done = False
        try:
            with self._masked("decode"), decode_launches(self.model.kernels.batch_invariant):
                yield
            done = True
        finally:
            for slot, entries in self.experts.end_window(adapt=done).items():
                self.announce(ResidencyEvent("adapt", self.devices[slot], tuple(entries)))

    def decode_window(self, batch: DecodeBatch) -> torch.Tensor:
        """One ``strata_decode_window`` under the decode placement, committed after it; float32
        logits ``[B, vocab]``. A failed window leaves the caches as they were (no adaptation)."""
        for session in batch.sessions:
            self._place(session, "decode")
        offsets = batch.offsets or (0,) * len(batch)
        first = [session.n_tokens + offset for session, offset in zip(batch.sessions, offsets)]
        self._pass_hidden = None
        with self._decode_phase():
            logits = self._hook.strata_decode_window(ctx=self.context, batch=batch)
        for session, token in zip(batch.sessions, [UNSET] * len(batch) if batch.fed else batch.tokens.tolist()):
            session.kv.advance(1)
            session.tokens.append(token)
        self._sink(batch.runs(first))
        return logits

    def serve_segment(self, phase: Phase, segment: Segment, hidden: torch.Tensor,
                      batch: PromptBatch | DecodeBatch) -> torch.Tensor:
        """Run ``segment`` of a step rank 0 sent to this rank (remote/stages.py) under the phase's
        masking, a decode segment as a window of the expert caches; the caller commits the positions."""
        if phase == "prompt":
            with self._masked("prompt"):
                return self.prefill_segment(segment, hidden, batch)
        with self._decode_phase():
            return self.decode_segment(segment, hidden, batch)

    # --- building blocks (the PhaseContext) --------------------------------------------------------

    def segments(self, phase: Phase) -> tuple[Segment, ...]:
        """The maximal runs of consecutive layers on one device slot in ``phase``, in layer order."""
        return self._segments[phase]

    def device_of(self, segment: Segment) -> torch.device:
        """The torch device of ``segment``'s device slot."""
        return self.devices[segment.device].device

    @property
    def telemetry(self) -> ExpertTelemetry:
        """The expert-residency counters."""
        return self.experts.telemetry

    def embed(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Token embeddings ``[T, H]`` on ``device``."""
        with device_scope(self.main.device):
            return self.model.embed(to_device(tokens, self.main.device)).to(device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output norm + head on the main device: float32 logits ``[T, vocab]`` (``hidden``, a decode
        window's rows, is kept for the hidden sink while one is set; ``run_prompt`` keeps all its rows)."""
        if self.hidden_sink is not None:
            self._pass_hidden = hidden
        with device_scope(self.main.device):
            return self.model.head(hidden.to(self.main.device)).float()

    @contextmanager
    def observe_layers(self, observer: LayerObserver) -> Iterator[None]:
        """Call ``observer(layer, hidden)`` after every layer while the block runs."""
        self._observers.append(observer)
        try:
            yield
        finally:
            self._observers.remove(observer)

    @property
    def observers(self) -> tuple[LayerObserver, ...]:
        """The layer observers now watching."""
        return tuple(self._observers)

    @contextmanager
    def time_stages(self) -> Iterator[list[StageTime]]:
        """Record ``(label, start, end)`` per segment run while the block runs."""
        self._stage_times = []
        try:
            yield self._stage_times
        finally:
            self._stage_times = None

    def _notify(self, layer: int, hidden: torch.Tensor) -> None:
        for observer in self._observers:
            observer(layer, hidden)

    @contextmanager
    def _timed(self, phase: Phase, segment: Segment) -> Iterator[None]:
        """Record the segment's device time while a timing observer asks (``time_stages``)."""
        if self._stage_times is None:
            yield
            return
        label = f"{phase} {self.devices[segment.device]}[{segment.layers.start}..{segment.layers.stop - 1}]"
        device = self.device_of(segment)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(device))
            yield
            end.record(torch.cuda.current_stream(device))
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._stage_times.append((label, start, end))

    def _through(self, phase: Phase, segments: tuple[Segment, ...], hidden: torch.Tensor,
                 batch: PromptBatch | DecodeBatch) -> torch.Tensor:
        """``hidden`` through ``segments`` in order; a run of consecutive segments on other ranks is one
        chain (each rank's output goes straight to the next)."""
        run = self.prefill_segment if phase == "prompt" else self.decode_segment
        i = 0
        while i < len(segments):
            j = i
            while self._remote is not None and j < len(segments) and self._remote.remote(segments[j]):
                j += 1
            if j > i:
                hidden = self._remote.run(phase, segments[i:j], hidden, batch)
                i = j
            else:
                hidden = run(segments[i], hidden, batch)
                i += 1
        return hidden

    # --- the prompt loop ---------------------------------------------------------------------------

    def prefill_segment(self, segment: Segment, hidden: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        """Run a prompt batch's ``hidden [T, H]`` through ``segment`` (prompt placement) on its device:
        attention (and its KV writes) session by session, everything else over every row at once; on
        another rank, one hop there and back."""
        if self._remote is not None and self._remote.remote(segment):
            return self._remote.run("prompt", [segment], hidden, batch)
        device = self.device_of(segment)
        positions = to_device(batch.positions, device)
        rows = self.experts.rows_for(segment.device, "prompt")
        spans = batch.spans
        hidden = hidden.to(device)

        sessions = [(session.kv, a, b, session.n_tokens + b - a) for session, a, b in spans]  # each over its own KV
        with device_scope(device), self._timed("prompt", segment):
            for layer in segment.layers:
                hidden = self.model.moe(layer, self.model.attention_spans(layer, hidden, positions, sessions), rows)
                self._notify(layer, hidden)
        return hidden

    def run_prompt(self, batch: PromptBatch, logits: LogitsWanted) -> torch.Tensor:
        """One prompt batch through the prompt placement's segments; the head only where asked
        (``last``: each chunk's last position). A pass of new sessions replays a CUDA graph where prompt
        graphs apply (runtime/prompt_graphs.py)."""
        if logits == "last":
            out = self._replay_prompt(batch)
            if out is not None:
                return out
        segments = self._segments["prompt"]
        hidden = self.embed(batch.tokens, self.device_of(segments[0]))  # [T, H]
        hidden = self._through("prompt", segments, hidden, batch)
        if logits == "none":
            out = torch.empty((0, self.model.spec.vocab_size), dtype=torch.float32, device=self.main.device)
        elif logits == "all":
            out = self.head(hidden)
        else:
            out = self.head(hidden[-1:] if len(batch) == 1 else hidden[to_device(batch.last_rows, hidden.device)])
        if self.hidden_sink is not None:  # every row, not only those of the logits
            self._pass_hidden = hidden
        return out

    # --- the decode loop ---------------------------------------------------------------------------

    def decode_layers(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch,
                      positions: torch.Tensor | None = None, tables: torch.Tensor | None = None,
                      static: bool = False, fused: bool | None = None) -> torch.Tensor:
        """The decode loop: one token per session ``[B, H]`` through ``segment``'s layers, on the
        device of ``hidden``; eager windows and graph captures both run it.

        Each layer is the fused one (model/fused_decode.py: few launches, the residual add carried
        into the next layer's norm) where the model and device allow; one session's row on the CPU
        takes ``MoEModel.cpu_layer`` where it applies (its joined ops, the add carried the same way);
        else the attention block's norm and projections over every row at once and its attention per session
        (``attention_spans``; on the CPU each row's bits its own; under ``--batch-invariant`` off the CPU per
        row), then the batched MoE rows (a recurrent layer keeps its state after each row where the window asks
        it to). ``positions`` (``[B]`` on the device) and ``tables`` (the KV address tables) are a graph's static
        inputs; ``static`` attends over the whole KV capacity, masked from the positions (what a graph needs, and
        what the CPU path always does). ``fused`` picks the layer (None: the fused one where ``why_not_fused``
        allows; on the CPU its ops run their references).
        """
        device = hidden.device
        positions = to_device(batch.positions, device) if positions is None else positions
        # under --batch-invariant an eager window attends as a replayed one (the whole capacity, masked): a row's
        # bits do not depend on whether its window replayed a graph
        static = static or (self.model.kernels.batch_invariant and device.type != "cpu")
        rows = self.experts.rows_for(segment.device, "decode")
        if fused is None:
            fused = self._fused_on(device)
        if fused and tables is None:
            tables = to_device(kv_tables(batch.sessions, segment.layers), device)
        delta = None
        # each row attends over its own position and those before it
        contexts = [] if fused else (batch.positions + 1).tolist()
        # a session's rows attend together; under --batch-invariant off the CPU each row alone (one shape a row,
        # whatever its window), the CPU's rows being their own either way
        by_row = self.model.kernels.batch_invariant and device.type != "cpu"
        spans = [] if fused else batch.spans(contexts, by_row)
        for i, layer in enumerate(segment.layers):
            if fused:
                hidden, delta = fused_decode_layer(self.model, layer, hidden, delta, positions, batch.sessions, rows,
                                                   tables[i])
            elif len(batch.sessions) == 1 and not batch.offsets:  # one row: the window's tensors as they are
                kv = batch.sessions[0].kv
                if self.model.takes_cpu_layer(layer, hidden, kv):  # the residual add rides in the next norm
                    hidden, delta = self.model.cpu_layer(layer, hidden, delta, positions, kv, contexts[0], rows,
                                                         static)  # [1, H] each
                else:
                    if delta is not None:
                        hidden, delta = hidden + delta, None
                    hidden = self.model.moe(layer, self.model.attention(layer, hidden, positions, kv, contexts[0],
                                                                        static=static), rows)  # [1, H]
            else:  # the norm and projections over every row at once, the attention per span
                hidden = self.model.moe(layer, self.model.attention_spans(layer, hidden, positions, spans, static),
                                        rows)  # [B, H]
            if self._observers:
                self._notify(layer, hidden if delta is None else hidden + delta)
        return hidden if delta is None else hidden + delta

    def _fused_on(self, device: torch.device) -> bool:
        """Whether decode layers on ``device`` take the fused path (decided once per device)."""
        if device not in self._fused:
            self._fused[device] = why_not_fused(self.model, device) is None
        return self._fused[device]

    def decode_segment(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per session ``[B, H]`` through ``segment`` (decode placement): a replayed CUDA
        graph where it applies (``--cuda-graphs``), else the eager loop; on another rank, one hop there
        and back."""
        if self._remote is not None and self._remote.remote(segment):
            return self._remote.run("decode", [segment], hidden, batch)
        hidden = hidden.to(self.device_of(segment))
        with device_scope(hidden.device), self._timed("decode", segment):
            if self._graphed(segment) and not batch.keeps_steps:
                out = self._replay_segment(segment, hidden, batch)
                if out is not None:
                    return out
            return self.decode_layers(segment, hidden, batch)

    def run_decode(self, batch: DecodeBatch) -> torch.Tensor:
        """One decode window through the decode placement's segments, then the head; with one segment
        on the main device, embedding, layers and head replay as one graph where graphs apply (not while
        a hidden sink reads the layers' output)."""
        segments = self._segments["decode"]
        if len(segments) == 1 and self._stage_times is None and not batch.keeps_steps and self.hidden_sink is None:
            logits = self._replay_step(segments[0], batch)
            if logits is not None:
                return logits
        hidden = self.embed(batch.tokens, self.device_of(segments[0]))  # [B, H]
        return self.head(self._through("decode", segments, hidden, batch))
