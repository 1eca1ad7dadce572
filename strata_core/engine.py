"""Engine: load a GGUF MoE model under a strategy, keep its sessions, generate text.

The engine knows no topology by name: at load it asks the selected strategy for the placement,
loads the dense weights and the expert backend for it (engine_load.py), and builds the :class:`Runner` that
executes it (runtime/runner.py: the layer loops, CUDA graphs, masking and hand-off around each phase). What
stays here is the public API: sessions, ``prefill``, ``decode_window``, ``logits``, ``generate``,
each checking its input before the runner sees it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from strata_core.config import StrataSettings
from strata_core.engine_load import kv_pools, load_parts
from strata_core.errors import RequestError
from strata_core.experts.backend import ExpertBackend
from strata_core.gguf.reader import GGUFFile
from strata_core.model import kvtransfer
from strata_core.model.kvcache import KVCache
from strata_core.model.kvpool import KVPoolFull, KVPools
from strata_core.model.mtp import MtpHead, mtp_block_spec
from strata_core.model.spec import ModelSpec
from strata_core.model.transformer import MoEModel
from strata_core.plugin.manager import StrataPluginManager
from strata_core.plugin.placement import PHASES, DeviceSlot, Phase, Placement
from strata_core.plugin.spec import StrategyOptions
from strata_core.remote import Cluster, RankFailedError, RemoteStages
from strata_core.runtime.devices import compute_dtype, synchronize
from strata_core.runtime.runner import Runner
from strata_core.runtime.session import DecodeBatch, Session, SessionSnapshot
from strata_core.serving.mtp_drafts import MtpDrafts
from strata_core.serving.sampling import Sampler, SamplingParams
from strata_core.text.chat import ChatTemplate
from strata_core.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

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
        pools: KVPools | None = None,
        remote: RemoteStages | None = None,
        local: frozenset[int] | None = None,
    ) -> None:
        self.settings = settings
        self.plugins = plugins
        self.gguf_file = gguf_file
        self.spec = spec
        self.devices = devices
        self.placement = placement
        self.model = model
        self.experts = experts
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_context = min(settings.max_context, spec.context_length)
        self.dtype = compute_dtype(settings.dtype, devices[placement.main].device)
        #: the segments on other ranks (strata_core/remote/), None for an engine in one process
        self.remote = remote
        #: the device slots this process computes on (every slot, but for an engine over several ranks)
        self.local = local if local is not None else frozenset(d.index for d in devices)
        self.runner = Runner(settings, plugins.hook, options, devices, placement, model, experts,
                             self._padding_session, remote)
        #: the paged KV: a block pool per device slot holding the layers any phase places there
        self.kv_pools = pools if pools is not None else kv_pools(settings, spec, self.dtype)
        for phase in PHASES:
            for layer, placed in enumerate(placement.layers(phase)):
                if placed.device in self.local:
                    pool = self.kv_pools.pool(placed.device, devices[placed.device].device)
                    pool.add_layer(layer, spec.layer_state(layer))
        self.kv_pools.log_sizes({d.index: d for d in devices if d.index in self.local})
        #: the MTP block's drafts of every session (``--spec mtp``; ``load_mtp``), else None
        self.mtp: MtpDrafts | None = None

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
    def from_settings(cls, settings: StrataSettings, progress: Callable[[float], None] | None = None,
                      cluster: Cluster | None = None) -> Engine:
        """Load the model named by ``settings`` (validated before any weight is read).

        ``progress`` is called with the fraction loaded (0 to 1) as the dense weights, the arena
        and the expert caches come in (the server's ``/health`` reports it). Where ``--devices`` names
        other ranks' devices this process joins them (``cluster``: joined already) and loads only
        the layers of its own device slots; rank 0 waits for the other ranks to load theirs.
        """
        report = progress or (lambda fraction: None)
        engine = cls(**vars(load_parts(settings, report, cluster)))
        engine.runner.plan_residency()
        if settings.spec == "mtp":
            engine.load_mtp()
        if engine.remote is not None:
            engine.remote.ready()
        report(1.0)
        return engine

    def load_mtp(self) -> None:
        """Load the model's first MTP block on the main device and keep every session's hidden rows for it
        (``mtp``, ``draft``); ConfigError when the file has none."""
        block = mtp_block_spec(self.settings.model, self.spec)
        device = self.devices[self.placement.main].device
        head = MtpHead.load(self.gguf_file, self.spec, self.model, kv_pools(self.settings, block, self.dtype),
                            self.max_context, device, self.dtype)
        self.mtp = MtpDrafts(head, self.settings.prefill_chunk, self.settings.spec_min_p)
        self.runner.hidden_sink = self.mtp.take
        log.info("MTP drafting: the block blk.%d of %s on %s", self.spec.n_layers, self.settings.model, device)

    def close(self) -> None:
        """Release device memory and background work (and stop the other ranks)."""
        self.experts.close()
        if self.remote is not None:
            self.remote.close()

    @property
    def broken(self) -> RankFailedError | None:
        """Why this engine cannot run any more (a rank died or stopped answering), or None."""
        return None if self.remote is None else self.remote.cluster.failure

    def resident_experts(self) -> set[tuple[int, int]]:
        """The (layer, expert) entries every device cache holds, other ranks' included."""
        held = {entry for table in self.experts.tables.values() for entry in table.resident()}
        return held if self.remote is None else held | self.remote.resident()

    # --- sessions ---------------------------------------------------------------------------------

    def new_session(self, prefix_tokens: Sequence[int] = ()) -> Session:
        """A session of up to ``max_context`` positions, each layer on the device slot that computes
        it in the prompt placement, its KV in blocks of the engine's pools taken as it grows.

        ``prefix_tokens``: the session starts holding the longest run of published full KV blocks
        (kvpool.py: a finished prefill publishes its full blocks) that ``prefix_tokens`` begins with,
        shared with the sessions holding them (no copy, no recompute); ``session.tokens`` says how
        many positions that is (a multiple of ``--kv-block``; 0 for a model with recurrent state).
        Pass a prompt without its last token when that token's logits are wanted.
        """
        session = self._session_at_home("prompt")
        if prefix_tokens and self.shares_prefixes:
            session.tokens.extend(list(prefix_tokens)[:session.kv.share(prefix_tokens)])
        return session

    @property
    def shares_prefixes(self) -> bool:
        """Whether a new session takes over the published KV blocks its prompt starts with: a model without
        recurrent state (its state at a block boundary is not kept), in one process (across ranks the
        other ranks' KV holds no shared prefix)."""
        return self.spec.rewindable and self.remote is None

    def _padding_session(self) -> Session:
        """A session at home in the decode placement whose rows pad a graphed window: it writes and reads
        position 0 only, so it holds one block of each pool."""
        session = self._session_at_home("decode")
        session.kv.reserve(1)
        return session

    def _session_at_home(self, phase: Phase) -> Session:
        """An empty session of ``max_context`` positions, each layer on its device slot in ``phase``."""
        homes = {layer: (placed.device, self.devices[placed.device].device)
                 for layer, placed in enumerate(self.placement.layers(phase)) if placed.device in self.local}
        return Session(kv=KVCache.for_spec(self.spec, self.max_context, dtype=self.dtype, layers=sorted(homes),
                                           homes=homes, pools=self.kv_pools))

    def capture_decode_graphs(self, sessions: int) -> None:
        """Capture the CUDA graphs of decode windows of up to ``sessions`` sessions now (see
        ``Runner.capture_buckets``), so serving them never captures."""
        self.runner.capture_buckets(sessions)

    def capture_prompt_graphs(self) -> None:
        """Capture the CUDA graphs of prompt passes of new sessions now, where they apply
        (``Runner.capture_prompts``), so serving them never captures."""
        self.runner.capture_prompts()

    def warm_up_prompts(self) -> None:
        """Run throw-away prompts, so that the first requests do not compile or plan the prompt path's
        kernels: one prompt alone and a batch of two, of lengths that do and do not divide by 16 (Triton
        specializes a kernel on that), each skipped if the KV pool cannot hold it; logs the time. The
        counters are reset after them."""
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        limit = min(self.max_context, self.settings.prefill_chunk)

        def ids(n: int) -> list[int]:
            return torch.randint(0, self.spec.vocab_size, (min(n, limit),), generator=gen).tolist()

        done = 0
        for group in ([64], [67], [48, 37]):
            sessions = [self.new_session() for _ in group]
            try:
                self.prefill_batch([(session, ids(n)) for session, n in zip(sessions, group)])
                done += len(group)
            except KVPoolFull:  # a pool smaller than the warm-up: those kernels compile at a first request
                pass
            finally:
                for session in sessions:
                    self.release_session(session)
        synchronize(self.runner.main.device)
        self.telemetry.reset()
        log.info("warmed up the prompt path (%d prompts) in %.2f s", done, time.perf_counter() - start)

    def release_session(self, session: Session, cache: bool = False) -> None:
        """Give a session's KV blocks back to the pools (shared ones stay with their other holders). With
        ``cache`` its committed full blocks are published first: they stay on the device, cached, until an
        allocation needs them, and a later prompt that starts with the same tokens takes them back
        (kvpool.py). Published blocks stay cached either way."""
        if cache:
            session.kv.publish(session.tokens)
        session.kv.release()
        session.tokens.clear()
        if self.mtp is not None:
            self.mtp.release(session)

    def save_session(self, session: Session) -> SessionSnapshot:
        """A host-RAM copy of ``session`` (the conversation cache keeps these)."""
        return SessionSnapshot(tokens=tuple(session.tokens), kv=kvtransfer.snapshot(session.kv))

    def restore_session(self, snapshot: SessionSnapshot) -> Session:
        """A live session equal to the one saved in ``snapshot``: the leading blocks another session
        has published are shared, the rest copied in from the snapshot."""
        session = self.new_session(snapshot.tokens)
        try:
            kvtransfer.restore(session.kv, snapshot.kv, keep=session.n_tokens)
        except Exception:
            self.release_session(session)
            raise
        session.tokens[:] = snapshot.tokens
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
        result = self._prefill_tokens(session, self._prompt_tokens(session, token_ids), all_logits)
        return result if all_logits else result[-1]

    def prefill_batch(self, chunks: Sequence[tuple[Session, Sequence[int]]]) -> torch.Tensor:
        """Extend each session by its chunk, the chunks computed together in passes of at most
        ``--prefill-chunk`` tokens (a longer chunk alone, in chunks of that size); float32 logits
        ``[len(chunks), vocab]`` of each chunk's last position. Each session appears once."""
        prompts = [(session, self._prompt_tokens(session, ids)) for session, ids in chunks]
        groups: list[list[tuple[Session, torch.Tensor]]] = []
        size = 0  # tokens of the last group
        for session, tokens in prompts:
            if not groups or size + len(tokens) > self.settings.prefill_chunk:
                groups.append([])
                size = 0
            groups[-1].append((session, tokens))
            size += len(tokens)
        return torch.cat([self._prefill_group(group) for group in groups])

    def _prefill_tokens(self, session: Session, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """Checked ``tokens`` through the runner (chunked), the KV reserved, trimmed and published."""
        session.kv.reserve(session.n_tokens + len(tokens))
        try:
            result = self.runner.prefill(session, tokens, all_logits)
        finally:
            session.kv.trim()
        session.kv.publish(session.tokens)
        return result

    def _prefill_group(self, group: list[tuple[Session, torch.Tensor]]) -> torch.Tensor:
        """``[len(group), vocab]``: one chunk alone (chunked if it is long), several in one pass."""
        if len(group) == 1:
            (session, tokens), = group
            return self._prefill_tokens(session, tokens, all_logits=False)
        try:
            for session, tokens in group:
                session.kv.reserve(session.n_tokens + len(tokens))
            logits = self.runner.prefill_batch(group)
        finally:
            for session, _ in group:
                session.kv.trim()
        for session, _ in group:
            session.kv.publish(session.tokens)
        return logits

    def _prompt_tokens(self, session: Session, token_ids: Sequence[int]) -> torch.Tensor:
        """``token_ids`` as int64, checked: not empty, in the vocabulary, room in the session."""
        if len(token_ids) == 0:
            raise RequestError("the prompt is empty")
        self._check_room(session, len(token_ids))
        tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.spec.vocab_size:
            raise RequestError(f"token ids must be in [0, {self.spec.vocab_size})")
        return tokens

    def decode_window(self, steps: Sequence[tuple[Session, int]], fed: torch.Tensor | None = None) -> torch.Tensor:
        """Append each step's token to its session; float32 logits ``[len(steps), vocab]``. A session's
        steps, if several, are consecutive: its next tokens in order (a speculative window verifying
        drafted tokens: row j's logits follow the session's tokens up to its j-th; its session may then be
        truncated back to any of those positions, recurrent state too: ``KVCache.keep_steps``). ``fed``: the tokens
        as int64 ``[len(steps)]`` on the device (the steps' own are ignored), read there without a host
        wait; each session records ``UNSET`` for them until ``Session.settle``."""
        counts: dict[int, int] = {}
        offsets = []
        for i, (session, _) in enumerate(steps):
            if i and session is not steps[i - 1][0] and id(session) in counts:
                raise ValueError("a session's steps in a decode window must be consecutive")
            offsets.append(counts.get(id(session), 0))
            counts[id(session)] = offsets[-1] + 1
        sessions = tuple(s for s, _ in steps)
        unique = list({id(s): s for s in sessions}.values())
        for session in unique:
            self._check_room(session, counts[id(session)])
        tokens = torch.tensor([t for _, t in steps], dtype=torch.int64) if fed is None else fed
        batch = DecodeBatch(sessions=sessions, tokens=tokens, fed=fed is not None,
                            offsets=tuple(offsets) if len(unique) < len(sessions) else ())
        try:
            for session in unique:
                session.kv.reserve(session.n_tokens + counts[id(session)])
                if counts[id(session)] > 1:  # its rows may be cut back after the window: recurrent state too
                    session.kv.keep_steps()
            return self.runner.decode_window(batch)
        finally:
            for session in unique:
                session.kv.trim()

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
