"""Engine: load a GGUF MoE model under a strategy, run sessions, generate text.

The engine knows no topology by name: it asks the selected strategy for the placement and executes
it. A request is four steps, all here: the prompt placement runs the prompt (``strata_prefill`` per
chunk; the core default is :meth:`Engine.run_prompt`), with the residency entries the phase must not
see masked in place (phase_state.py); the layers whose decode placement is another device slot are
handed off (``strata_hand_off``, once per prompt segment); the decode placement runs the windows
(``strata_decode_window``; default :meth:`Engine.run_decode`). A strategy that splits a window
itself composes :meth:`Engine.embed`, :meth:`Engine.decode_segment` and :meth:`Engine.head`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from strata_core.text.chat import ChatTemplate
from strata_core.config import StrataSettings
from strata_core.runtime.devices import device_scope, resolve_devices, to_device
from strata_core.errors import ConfigError, RequestError
from strata_core.experts.backend import ExpertBackend, build_expert_backend
from strata_core.experts.sizing import check_dense_budget
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import get_architecture, load_model_spec
from strata_core.model.spec import ModelSpec
from strata_core.runtime.graphs import DecodeGraphs
from strata_core.runtime.memory_plan import dense_bytes_per_device
from strata_core.model.kvcache import KVCache
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights
from strata_core.model.fused_decode import decode_layers as fused_decode_layers, fused_reason, place_q8_copies
from strata_core.model.fused_decode import kv_tables as fused_kv_tables
from strata_core.model.head_split import HeadSplit
from strata_core.runtime.phase_state import hidden_layers, masked_phase, place_state
from strata_core.plugin.events import ResidencyEvent
from strata_core.plugin.manager import StrataPluginManager, build_plugin_manager
from strata_core.plugin.placement import PHASES, DeviceSlot, Phase, Placement, Segment
from strata_core.plugin.spec import StrategyOptions
from strata_core.serving.sampling import Sampler, SamplingParams
from strata_core.runtime.session import DecodeBatch, LogitsWanted, Session, SessionSnapshot
from strata_core.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LayerObserver = Callable[[int, torch.Tensor], None]


def _head_splits(placement: Placement, slots: dict[int, DeviceSlot], spec: ModelSpec) -> dict[int, HeadSplit]:
    """Per prompt layer whose placement names an attention peer, the split of its heads with that peer
    (one ``HeadSplit`` per pair of devices): the peer takes half of the kv heads."""
    splits: dict[tuple[int, int], HeadSplit] = {}
    by_layer = {}
    for layer, placed in enumerate(placement.layers("prompt")):
        if placed.attention_peer is None:
            continue
        pair = (placed.device, placed.attention_peer)
        if pair not in splits:
            splits[pair] = HeadSplit(slots[pair[0]].device, slots[pair[1]].device, spec.n_kv_heads // 2)
            log.info("prompt attention: %d of %d kv heads of %s's layers on %s", spec.n_kv_heads // 2,
                     spec.n_kv_heads, slots[pair[0]], slots[pair[1]])
        by_layer[layer] = splits[pair]
    return by_layer


def _compute_dtype(settings: StrataSettings, device: torch.device) -> torch.dtype:
    if settings.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, settings.dtype)


class Engine:
    """A loaded model under one strategy. Not thread-safe: call it from one thread."""

    def __init__(
        self,
        settings: StrataSettings,
        plugins: StrataPluginManager,
        options: StrategyOptions,
        gguf_file: GGUFFile,
        spec: ModelSpec,
        devices: tuple[DeviceSlot, ...],
        placement: Placement,
        model: MoEModel,
        experts: ExpertBackend,
        tokenizer: Tokenizer | None,
        chat: ChatTemplate,
    ) -> None:
        self.settings = settings
        self.plugins = plugins
        self.hook = plugins.hook
        self.options = options  # the selected strategy's validated options
        self.gguf_file = gguf_file
        self.spec = spec
        self.devices = devices
        self.placement = placement
        self.main = devices[placement.main]
        self.model = model
        self.experts = experts
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_context = min(settings.max_context, spec.context_length)
        self.dtype = _compute_dtype(settings, self.main.device)
        self.segments = {phase: placement.segments(phase) for phase in PHASES}
        self.hidden_layers = hidden_layers(placement, placement.cached_layers())
        self.layer_observers: list[LayerObserver] = []
        #: (label, start, end) per segment run while a timing observer asks (``stage_timing``)
        self.stage_times: list[tuple[str, Any, Any]] | None = None
        self._graphs: DecodeGraphs | None = None  # --cuda-graphs, created on first use

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        strategy: str = "single",
        devices: Sequence[str] | None = None,
        **settings: Any,
    ) -> Engine:
        """Load ``path`` (default: the embedded demo model) under ``strategy`` on ``devices``.

        ``settings`` are :class:`StrataSettings` fields (``expert_cache=0``, ``prefill_chunk=512``).
        """
        values: dict[str, Any] = dict(settings, strategy=strategy)
        if path is not None:
            values["model"] = Path(path)
        if devices is not None:
            values["devices"] = list(devices)
        return cls.from_settings(StrataSettings(**values))

    @classmethod
    def from_settings(cls, settings: StrataSettings, progress: Callable[[float], None] | None = None) -> Engine:
        """Load the model named by ``settings`` (validated before any weight is read).

        ``progress`` is called with the fraction loaded (0 to 1) as the dense weights, the arena
        and the expert caches come in (the server's ``/health`` reports it).
        """
        report = progress or (lambda fraction: None)
        plugins = build_plugin_manager(settings)
        selected = plugins.select_strategy(settings.strategy, settings.strategy_options)
        devices = tuple(DeviceSlot(i, d) for i, d in enumerate(resolve_devices(settings.devices)))
        gguf_file = GGUFFile.open(settings.model)
        spec = load_model_spec(gguf_file)
        placement = plugins.hook.strata_topology(devices=list(devices), spec=spec, settings=settings,
                                                 options=selected.options)
        if placement is None:
            raise ConfigError(f"strategy {selected.spec.name!r} returned no placement")
        placement.validate(spec.n_layers, len(devices))
        log.info("model %s: %s, %d layers, %d experts (top-%d)", settings.model, spec.architecture,
                 spec.n_layers, spec.n_experts, spec.n_experts_used)
        for phase in PHASES:
            log.info("%s placement: %s", phase, "; ".join(
                f"{devices[s.device]} layers {s.layers.start}..{s.layers.stop - 1}" for s in placement.segments(phase)))
        slots = {d.index: d for d in devices}
        dtype = _compute_dtype(settings, slots[placement.main].device)
        dense_bytes = dense_bytes_per_device(spec, placement, slots, dtype,
                                             min(settings.max_context, spec.context_length))
        check_dense_budget(settings, dense_bytes)
        layer_devices: dict[int, set[torch.device]] = {}
        for phase in PHASES:
            for layer, placed in enumerate(placement.layers(phase)):
                layer_devices.setdefault(layer, set()).add(slots[placed.device].device)
        report(0.02)
        dense = DenseWeights.load(gguf_file, spec, dtype).place(layer_devices, slots[placement.main].device)
        model = get_architecture(spec.architecture).model(spec, dense)
        if model.splits_heads and spec.n_kv_heads >= 2:
            model.head_splits = _head_splits(placement, slots, spec)
        elif any(placed.attention_peer is not None for placed in placement.layers("prompt")):
            log.info("prompt attention: every head on the layer's device (%s attention with %s kv heads is not "
                     "split)", spec.architecture, getattr(spec, "n_kv_heads", "its own"))
        dense_bytes = place_q8_copies(model, gguf_file, settings, placement, slots, dense_bytes)
        report(0.2)
        experts = build_expert_backend(ExpertWeights(gguf_file, spec), spec, placement, slots, settings, dense_bytes,
                                       progress=lambda fraction: report(0.2 + 0.79 * fraction))
        has_tokenizer = "tokenizer.ggml.tokens" in gguf_file.metadata
        if not has_tokenizer:
            log.warning("%s has no tokenizer: only token ids can be used", settings.model)
        engine = cls(settings, plugins, selected.options, gguf_file, spec, devices, placement, model, experts,
                     Tokenizer.from_gguf(gguf_file.metadata) if has_tokenizer else None,
                     ChatTemplate.from_gguf(gguf_file.metadata))
        for slot in experts.tables:
            plugins.hook.strata_residency(engine=engine, event=ResidencyEvent("plan", devices[slot]))
        report(1.0)
        return engine

    def close(self) -> None:
        """Release device memory and background work."""
        self.experts.close()

    # --- layer helpers ----------------------------------------------------------------------------

    def device_of(self, segment: Segment) -> torch.device:
        """The torch device of ``segment``'s device slot."""
        return self.devices[segment.device].device

    def embed(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Token embeddings ``[T, H]`` on ``device``."""
        with device_scope(self.main.device):
            return self.model.embed(to_device(tokens, self.main.device)).to(device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output norm + head on the main device: float32 logits ``[T, vocab]``."""
        with device_scope(self.main.device):
            return self.model.head(hidden.to(self.main.device)).float()

    def _notify(self, layer: int, hidden: torch.Tensor) -> None:
        for observer in self.layer_observers:
            observer(layer, hidden)

    @contextmanager
    def _timed(self, phase: Phase, segment: Segment) -> Iterator[None]:
        """Record the segment's device time while a timing observer asks (``stage_times``)."""
        if self.stage_times is None:
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
        self.stage_times.append((label, start, end))

    def prefill_segment(self, segment: Segment, hidden: torch.Tensor, session: Session) -> torch.Tensor:
        """Run a chunk ``[T, H]`` of ``session`` through ``segment`` (prompt placement) on its device."""
        device = self.device_of(segment)
        n_ctx = session.n_tokens + hidden.shape[0]
        positions = to_device(torch.arange(session.n_tokens, n_ctx), device)
        rows = self.experts.rows_for(segment.device, "prompt")
        hidden = hidden.to(device)
        with device_scope(device), self._timed("prompt", segment):
            for layer in segment.layers:
                hidden = self.model.attention(layer, hidden, positions, session.kv, n_ctx)
                hidden = self.model.moe(layer, hidden, rows)
                self._notify(layer, hidden)
        return hidden

    def decode_segment(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch,
                       static_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run one token per session ``[B, H]`` through ``segment`` (decode placement); MoE rows are batched.

        With ``--cuda-graphs`` the segment runs as a captured CUDA graph where the shapes allow
        (graphs.py; eager otherwise). ``static_positions`` (``[B]`` on the segment's device) is the
        body that graph captures: attention over the whole KV capacity (``static``), no host values.
        """
        if static_positions is not None:  # the body of a graph capture: no timing events
            return self._decode_layers(segment, hidden, batch, static_positions)
        hidden = hidden.to(self.device_of(segment))
        with device_scope(hidden.device), self._timed("decode", segment):
            graphed = (self._decode_graphs().decode_segment(segment, hidden, batch)
                       if self.settings.cuda_graphs else None)
            return graphed if graphed is not None else self._decode_layers(segment, hidden, batch)

    def _decode_layers(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch,
                       static_positions: torch.Tensor | None = None,
                       kv_tables: torch.Tensor | None = None) -> torch.Tensor:
        static = static_positions is not None
        positions = static_positions if static else to_device(batch.positions, hidden.device)  # [B]
        rows = self.experts.rows_for(segment.device, "decode")
        if fused_reason(self.model, hidden.device) is None:  # few fused launches a layer (fused_decode.py)
            if kv_tables is None:
                kv_tables = to_device(fused_kv_tables(batch.sessions, segment.layers), hidden.device)
            return fused_decode_layers(self.model, segment.layers, hidden, positions, batch.sessions, rows,
                                       kv_tables, self._notify if self.layer_observers else None)
        for layer in segment.layers:
            hidden = torch.cat([
                self.model.attention(layer, hidden[b:b + 1], positions[b:b + 1], session.kv,
                                     session.n_tokens + 1, static=static)
                for b, session in enumerate(batch.sessions)
            ])  # [B, H]
            hidden = self.model.moe(layer, hidden, rows)
            self._notify(layer, hidden)
        return hidden

    def _decode_graphs(self) -> DecodeGraphs:
        """The CUDA-graph cache of ``--cuda-graphs`` (created on first use)."""
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        return self._graphs

    def run_prompt(self, session: Session, tokens: torch.Tensor, logits: LogitsWanted) -> torch.Tensor:
        """One prompt chunk through the prompt placement's segments; the head only where asked."""
        segments = self.segments["prompt"]
        hidden = self.embed(tokens, self.device_of(segments[0]))  # [T, H]
        for segment in segments:
            hidden = self.prefill_segment(segment, hidden, session)
        if logits == "none":
            return torch.empty((0, self.spec.vocab_size), dtype=torch.float32, device=self.main.device)
        return self.head(hidden if logits == "all" else hidden[-1:])

    def run_decode(self, batch: DecodeBatch) -> torch.Tensor:
        """One decode window through the decode placement's segments, then the head."""
        segments = self.segments["decode"]
        if self.settings.cuda_graphs and len(segments) == 1 and self.stage_times is None:
            with device_scope(self.device_of(segments[0])):  # embedding, layers and head in one replay
                logits = self._decode_graphs().decode_step(segments[0], batch)
            if logits is not None:
                return logits
        hidden = self.embed(batch.tokens, self.device_of(segments[0]))  # [B, H]
        for segment in segments:
            hidden = self.decode_segment(segment, hidden, batch)
        return self.head(hidden)

    # --- sessions ---------------------------------------------------------------------------------

    def new_session(self) -> Session:
        """An empty session with KV for ``max_context`` positions, each layer on the device slot that
        computes it in the prompt placement."""
        homes = {layer: (placed.device, self.devices[placed.device].device)
                 for layer, placed in enumerate(self.placement.prompt)}
        return Session(kv=KVCache.for_spec(self.spec, self.max_context, dtype=self.dtype, homes=homes))

    def release_session(self, session: Session) -> None:
        """Free a session's KV memory."""
        session.kv.release()
        session.tokens.clear()

    def save_session(self, session: Session) -> SessionSnapshot:
        """A host-RAM copy of ``session`` (the conversation cache keeps these)."""
        return SessionSnapshot(tokens=tuple(session.tokens), kv=session.kv.snapshot())

    def restore_session(self, snapshot: SessionSnapshot) -> Session:
        """A live session equal to the one saved in ``snapshot``."""
        session = self.new_session()
        session.kv.restore(snapshot.kv)
        session.tokens.extend(snapshot.tokens)
        return session

    # --- phases -----------------------------------------------------------------------------------

    def _check_room(self, session: Session, n_new: int) -> None:
        if session.n_tokens + n_new > self.max_context:
            raise RequestError(
                f"context is full: {session.n_tokens} tokens held + {n_new} new > "
                f"{self.max_context} (max_context)"
            )

    def prefill(self, session: Session, token_ids: Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Extend ``session`` by ``token_ids`` in chunks of ``--prefill-chunk``.

        :return: float32 logits of the last position ``[vocab]``, or ``[T, vocab]`` with ``all_logits``.
        """
        if len(token_ids) == 0:
            raise RequestError("the prompt is empty")
        self._check_room(session, len(token_ids))
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size:
            raise RequestError(f"token ids must be in [0, {self.spec.vocab_size})")
        outputs = []
        chunk = self.settings.prefill_chunk
        place_state(self, session, "prompt")
        with masked_phase(self, "prompt"):
            for start in range(0, len(tokens), chunk):
                piece = tokens[start:start + chunk]
                last = start + chunk >= len(tokens)
                want: LogitsWanted = "all" if all_logits else "last" if last else "none"
                logits = self.hook.strata_prefill(engine=self, session=session, tokens=piece, logits=want)
                session.kv.advance(len(piece))
                session.tokens.extend(piece.tolist())
                if want != "none":
                    outputs.append(logits)
        place_state(self, session, "decode")
        result = torch.cat(outputs)
        return result if all_logits else result[-1]

    def decode_window(self, steps: Sequence[tuple[Session, int]]) -> torch.Tensor:
        """Append one token to each session; float32 logits ``[len(steps), vocab]``."""
        for session, _ in steps:
            self._check_room(session, 1)
        batch = DecodeBatch(sessions=tuple(s for s, _ in steps),
                            tokens=torch.tensor([t for _, t in steps], dtype=torch.int64))
        for session in batch.sessions:
            place_state(self, session, "decode")
        self.experts.begin_window()
        logits = None
        try:
            with masked_phase(self, "decode"):
                logits = self.hook.strata_decode_window(engine=self, batch=batch)
        finally:  # a failed window leaves the caches as they were (no adaptation)
            for slot, entries in self.experts.end_window(adapt=logits is not None).items():
                self.hook.strata_residency(engine=self, event=ResidencyEvent("adapt", self.devices[slot],
                                                                             tuple(entries)))
        for session, token in steps:
            session.kv.advance(1)
            session.tokens.append(token)
        return logits

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits of every position of ``token_ids`` in a fresh session: float32 ``[T, vocab]``."""
        session = self.new_session()
        try:
            return self.prefill(session, token_ids, all_logits=True).cpu()
        finally:
            self.release_session(session)

    # --- generation -------------------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[str]:
        """Yield the generated text piece by piece (greedy when ``params.temperature == 0``)."""
        if self.tokenizer is None:
            raise RequestError(f"{self.settings.model} has no tokenizer: text cannot be encoded or decoded")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampler = Sampler(params)
        decoder = self.tokenizer.stream_decoder()
        session = self.new_session()
        try:
            logits = self.prefill(session, ids)
            history = list(ids)
            limit = params.max_tokens if params.max_tokens is not None else self.max_context
            for _ in range(limit):
                token = sampler.sample(logits, history)
                if token in self.tokenizer.eos_token_ids:
                    break
                history.append(token)
                text = decoder.push(token)
                if text:
                    yield text
                if session.n_tokens >= self.max_context:
                    break
                logits = self.decode_window([(session, token)])[0]
            tail = decoder.flush()
            if tail:
                yield tail
        finally:
            self.release_session(session)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, **sampling: Any) -> str:
        """Generate up to ``max_tokens`` tokens after ``prompt``; ``sampling`` are SamplingParams fields."""
        return "".join(self.stream(prompt, SamplingParams(max_tokens=max_tokens, **sampling)))

    @property
    def telemetry(self):
        """Expert-residency counters (hits, misses, bytes streamed, copy/compute time)."""
        return self.experts.telemetry
