"""Engine: load a GGUF MoE model under a strategy, run sessions, generate text.

The engine knows no topology by name: it asks the selected strategy for the plan and calls the
phase hooks (``strata_prefill`` per prompt chunk, ``strata_decode_window`` per window). Strategies
build their phases from the engine's layer helpers (:meth:`Engine.embed`,
:meth:`Engine.prefill_layers`, :meth:`Engine.decode_layers`, :meth:`Engine.head`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from strata_core.chat import ChatTemplate
from strata_core.config import StrataSettings
from strata_core.devices import resolve_devices, to_device
from strata_core.errors import ConfigError, RequestError
from strata_core.experts.backend import ExpertBackend, build_expert_backend
from strata_core.experts.sizing import check_dense_budget
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.spec import ModelSpec, load_model_spec
from strata_core.graphs import DecodeGraphs
from strata_core.memory_plan import dense_bytes_per_device
from strata_core.model import DenseWeights, KVCache, MoEModel
from strata_core.plugins import StrataPluginManager, build_plugin_manager
from strata_core.residency_events import ResidencyEvent
from strata_core.sampling import Sampler, SamplingParams
from strata_core.session import DecodeBatch, Session, SessionSnapshot
from strata_core.tokenizer import Tokenizer
from strata_core.topology import TopologyPlan

log = logging.getLogger(__name__)

LayerObserver = Callable[[int, torch.Tensor], None]


def _compute_dtype(settings: StrataSettings, device: torch.device) -> torch.dtype:
    if settings.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, settings.dtype)


class _PerDevice:
    """A small host tensor copied once to each device that asks for it (not once per layer)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.copies = {host.device: host}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self.copies:
            self.copies[device] = to_device(self.copies[torch.device("cpu")], device)
        return self.copies[device]


class Engine:
    """A loaded model under one strategy. Not thread-safe: call it from one thread."""

    def __init__(
        self,
        settings: StrataSettings,
        plugins: StrataPluginManager,
        gguf_file: GGUFFile,
        spec: ModelSpec,
        plan: TopologyPlan,
        model: MoEModel,
        experts: ExpertBackend,
        tokenizer: Tokenizer | None,
        chat: ChatTemplate,
    ) -> None:
        self.settings = settings
        self.plugins = plugins
        self.hook = plugins.hook
        self.gguf_file = gguf_file
        self.spec = spec
        self.plan = plan
        self.model = model
        self.experts = experts
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_context = min(settings.max_context, spec.context_length)
        self.dtype = _compute_dtype(settings, plan.main)
        self.layer_observers: list[LayerObserver] = []
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
    def from_settings(cls, settings: StrataSettings) -> Engine:
        """Load the model named by ``settings`` (validated before any weight is read)."""
        plugins = build_plugin_manager(settings)
        selected = plugins.select_strategy(settings.strategy, settings.strategy_options)
        devices = resolve_devices(settings.devices)
        gguf_file = GGUFFile.open(settings.model)
        spec = load_model_spec(gguf_file)
        plan = plugins.hook.strata_topology(devices=devices, spec=spec, settings=settings,
                                            options=selected.options)
        if plan is None:
            raise ConfigError(f"strategy {selected.spec.name!r} returned no topology plan")
        plan.validate(spec.n_layers)
        log.info("model %s: %s, %d layers, %d experts (top-%d)", settings.model, spec.architecture,
                 spec.n_layers, spec.n_experts, spec.n_experts_used)
        for stage in plan.stages:
            log.info("stage %s: layers %d..%d", stage.device, stage.layers.start, stage.layers.stop - 1)
        dtype = _compute_dtype(settings, plan.main)
        dense_bytes = dense_bytes_per_device(spec, plan, dtype, min(settings.max_context, spec.context_length))
        check_dense_budget(settings, dense_bytes)
        dense = DenseWeights.load(gguf_file, spec, dtype)
        for stage in plan.stages:
            dense.to(stage.device, layers=stage.layers, embed=False, head=False)
        dense.to(plan.main, layers=range(0), embed=True, head=True)
        model = MoEModel(spec, dense)
        experts = build_expert_backend(ExpertWeights(gguf_file, spec), spec, plan, settings, dense_bytes)
        has_tokenizer = "tokenizer.ggml.tokens" in gguf_file.metadata
        if not has_tokenizer:
            log.warning("%s has no tokenizer: only token ids can be used", settings.model)
        engine = cls(settings, plugins, gguf_file, spec, plan, model, experts,
                     Tokenizer.from_gguf(gguf_file.metadata) if has_tokenizer else None,
                     ChatTemplate.from_gguf(gguf_file.metadata))
        for device in experts.tables:
            plugins.hook.strata_residency(engine=engine, event=ResidencyEvent("plan", device))
        return engine

    def close(self) -> None:
        """Release device memory and background work."""
        self.experts.close()

    # --- layer helpers for strategies -----------------------------------------------------------

    def embed(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Token embeddings ``[T, H]`` on ``device``."""
        return self.model.embed(to_device(tokens, self.plan.main)).to(device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output norm + head on the main device: float32 logits ``[T, vocab]``."""
        return self.model.head(hidden.to(self.plan.main)).float()

    def _notify(self, layer: int, hidden: torch.Tensor) -> None:
        for observer in self.layer_observers:
            observer(layer, hidden)

    def prefill_layers(self, layers: range, hidden: torch.Tensor, session: Session) -> torch.Tensor:
        """Run a chunk ``[T, H]`` of ``session`` through ``layers`` on the layers' device."""
        n_ctx = session.n_tokens + hidden.shape[0]
        positions = _PerDevice(torch.arange(session.n_tokens, n_ctx))
        for layer in layers:
            device = self.model.weights.device_of(layer)
            hidden = self.model.attention(layer, hidden.to(device), positions.on(device), session.kv, n_ctx)
            hidden = self.model.moe(layer, hidden, self.experts.rows_for(device))
            self._notify(layer, hidden)
        return hidden

    def decode_layers(self, layers: range, hidden: torch.Tensor, batch: DecodeBatch,
                      static_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run one token per session ``[B, H]`` through ``layers``; MoE rows are batched.

        With ``--cuda-graphs`` the layers run as a captured CUDA graph where the shapes allow
        (graphs.py; eager otherwise). ``static_positions`` (``[B]`` on the layers' device) is the
        body that graph captures: attention over the whole KV capacity (``static``), no host values.
        """
        if static_positions is None and self.settings.cuda_graphs:
            graphed = self._decode_graphs().decode_layers(layers, hidden, batch)
            if graphed is not None:
                return graphed
        positions = _PerDevice(batch.positions) if static_positions is None else None
        static = static_positions is not None
        for layer in layers:
            device = self.model.weights.device_of(layer)
            hidden = hidden.to(device)
            on_device = positions.on(device) if positions is not None else static_positions  # [B]
            hidden = torch.cat([
                self.model.attention(layer, hidden[b:b + 1], on_device[b:b + 1], session.kv, session.n_tokens + 1,
                                     static=static)
                for b, session in enumerate(batch.sessions)
            ])  # [B, H]
            hidden = self.model.moe(layer, hidden, self.experts.rows_for(device))
            self._notify(layer, hidden)
        return hidden

    def _decode_graphs(self) -> DecodeGraphs:
        """The CUDA-graph cache of ``--cuda-graphs`` (created on first use)."""
        if self._graphs is None:
            self._graphs = DecodeGraphs(self)
        return self._graphs

    # --- sessions ---------------------------------------------------------------------------------

    def new_session(self) -> Session:
        """An empty session with KV for ``max_context`` positions, each layer on its stage's device."""
        kv = KVCache.for_spec(self.spec, self.max_context, device=self.plan.stages[0].device, dtype=self.dtype)
        for stage in self.plan.stages[1:]:
            kv.to(stage.device, layers=stage.layers)
        return Session(kv=kv)

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
        for start in range(0, len(tokens), chunk):
            piece = tokens[start:start + chunk]
            last = start + chunk >= len(tokens)
            logits = self.hook.strata_prefill(engine=self, session=session, tokens=piece,
                                              all_logits=all_logits or not last)
            session.kv.advance(len(piece))
            session.tokens.extend(piece.tolist())
            if all_logits or last:
                outputs.append(logits)
        result = torch.cat(outputs)
        return result if all_logits else result[-1]

    def decode_window(self, steps: Sequence[tuple[Session, int]]) -> torch.Tensor:
        """Append one token to each session; float32 logits ``[len(steps), vocab]``."""
        for session, _ in steps:
            self._check_room(session, 1)
        batch = DecodeBatch(sessions=tuple(s for s, _ in steps),
                            tokens=torch.tensor([t for _, t in steps], dtype=torch.int64))
        self.experts.begin_window()
        try:
            logits = self.hook.strata_decode_window(engine=self, batch=batch)
        finally:
            self.experts.end_window()
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
