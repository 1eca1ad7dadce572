"""The CUDA-graph half of :class:`~strata_core.runtime.runner.Runner`: where decode windows and prompt passes
replay graphs, and their capture at a server's start.

A decode window replays the graph of its batch bucket (runtime/graphs.py; padded with the padding session's
rows, runtime/buckets.py): the whole step (embedding, layers, head) where one segment on the main device
computes every layer, else one graph per segment; no graph depends on which sessions fill its rows. A prompt
pass of new sessions replays the graph of its token bucket (runtime/prompt_graphs.py). Each says once why it
does not apply (``why_not_graphed``, ``why_no_prompt_graphs``) and runs eagerly then.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from strata_core.model.fused_decode import kv_tables, why_not_fused
from strata_core.plugin.placement import Segment
from strata_core.runtime.devices import device_scope
from strata_core.runtime.graphs import BUCKETS, DecodeGraphs
from strata_core.runtime.invariance import decode_launches
from strata_core.runtime.prompt_graphs import PROMPT_BUCKETS, PromptGraphs, why_not_packed
from strata_core.runtime.session import DecodeBatch, PromptBatch
from strata_core.runtime.stand_ins import StandIns

__all__ = ["GraphReplays"]

log = logging.getLogger(__name__)

#: the fewest sessions a captured prompt pass packs (more with ``--parallel``)
PROMPT_SESSIONS = 16


class GraphReplays:
    """The runner's graph replays and captures (a part of :class:`~strata_core.runtime.runner.Runner`, which
    holds the state they read: settings, model, experts, segments, the padding, ``_graphs``, ``_prompt_graphs``,
    ``_stand_ins``)."""

    def _replay_prompt(self, batch: PromptBatch) -> torch.Tensor | None:
        """The last rows' logits of ``batch`` by a replayed prompt graph, or None where none applies."""
        graphs = self.prompt_graphs
        if graphs is None or self._observers or self.hidden_sink is not None or self._stage_times is not None:
            return None
        if graphs.why_not(batch) is not None:
            return None
        try:
            with device_scope(graphs.device):
                return graphs.run(batch)
        except Exception:  # noqa: BLE001 - a failed capture leaves prompt passes eager, said once
            log.warning("cuda graphs: prompt passes run eagerly from now on: %s", graphs.failed)
            return None

    @property
    def prompt_graphs(self) -> PromptGraphs | None:
        """The CUDA graphs of prompt passes, where they apply (``why_no_prompt_graphs``; the reason they
        do not is logged once)."""
        if self._prompt_graphs is None:
            reason = self.why_no_prompt_graphs()
            if reason is not None:
                if reason not in self._said:
                    self._said.add(reason)
                    log.info("cuda graphs: prompt passes run eagerly: %s", reason)
                return None
            segment = self._segments["prompt"][0]
            self._prompt_graphs = PromptGraphs(self.model, segment.layers, self.experts, segment.device,
                                               self.device_of(segment), self._padding,
                                               max(self.settings.parallel, PROMPT_SESSIONS),
                                               min(self.settings.prefill_chunk, PROMPT_BUCKETS[-1]),
                                               lambda: self.graphs.captures)
        return self._prompt_graphs

    def why_no_prompt_graphs(self) -> str | None:
        """Why prompt passes cannot replay CUDA graphs on this engine, or None when they can."""
        segments = self._segments["prompt"]
        if not self.settings.cuda_graphs:
            return "--cuda-graphs is off"
        if self.model.kernels.batch_invariant:
            return "--batch-invariant fixes the prompt path's launches"
        if len(segments) != 1 or segments[0].device != self.placement.main:
            return "the prompt placement has several segments, or not on the main device"
        slot = segments[0].device
        device = self.device_of(segments[0])
        if device.type != "cuda" or (self._remote is not None and self._remote.remote(segments[0])):
            return f"the prompt runs on {self.devices[slot]}, not a local CUDA device"
        return why_not_packed(self.model, self.experts, slot, segments[0].layers, device, self._padding.session,
                              str(self.devices[slot]))

    def _replay_segment(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch) -> torch.Tensor | None:
        """``[B, H]`` out of ``segment`` by the replayed graph of the window's bucket, or None. The fused kernels
        reach the KV through address tables among the graph's inputs; the unfused layers run on stand-ins
        (runtime/stand_ins.py) fed the rows' block tables: either way one graph serves any sessions."""
        padded, live = self._padding.pad(batch)
        fused = self._fused_on(hidden.device)
        inputs = {"hidden": F.pad(hidden, (0, 0, 0, len(padded) - len(batch))), "positions": padded.positions,
                  "live": self._padding.live_pairs(live)}
        if fused:
            inputs["tables"], window = kv_tables(padded.sessions, segment.layers), padded
        else:
            stand_ins = self._stand_ins_of(segment)
            reason = stand_ins.why_not(padded)
            if reason is not None:
                self._say(reason)
                return None
            inputs["tables"], window = stand_ins.tables(padded), stand_ins.window(padded)
            stand_ins.load(padded, window, live)

        def body(static: dict[str, torch.Tensor]) -> torch.Tensor:
            if not fused:
                stand_ins.follow(window, static["tables"])
            with self._padding.counting(self.experts.rows_for(segment.device, "decode"), static["live"]):
                return self.decode_layers(segment, static["hidden"], window, static["positions"],
                                          static["tables"] if fused else None, static=True)

        out = self.graphs.replay(segment, window, inputs, body, live=live)
        if not fused and out is not None:
            stand_ins.store(padded, window, live)
        return None if out is None else out[:len(batch)]

    def _stand_ins_of(self, segment: Segment) -> StandIns:
        key = (segment.device, segment.layers.start, segment.layers.stop)
        if key not in self._stand_ins:
            self._stand_ins[key] = StandIns(segment)
        return self._stand_ins[key]

    def capture_buckets(self, sessions: int) -> None:
        """Capture the decode graphs of every bucket a window of up to ``sessions`` sessions takes, now
        (a server's start: no capture after it, whoever joins or leaves), by running one window of
        padding rows per bucket; logs the buckets and the time it took. Nothing where graphs do not apply."""
        start = time.perf_counter()
        windows = []
        self.experts.begin_window()  # where graphs apply is decided inside a window (the decode gather)
        try:
            if not self.settings.cuda_graphs or not all(map(self._graphed, self._segments["decode"])):
                return
            windows = self._padding.windows(sessions)
            with self._masked("decode"), decode_launches(self.model.kernels.batch_invariant):
                for window in windows:
                    self.run_decode(window)
        finally:
            self.experts.end_window(adapt=False)
        if self.main.device.type == "cuda":
            torch.cuda.synchronize(self.main.device)
        log.info("cuda graphs: decode windows of %s session(s) captured in %.2f s (%d graphs)",
                 ", ".join(str(len(w)) for w in windows), time.perf_counter() - start, len(self.graphs))

    def capture_prompts(self) -> None:
        """Capture the prompt passes of every token bucket now, where prompt graphs apply."""
        graphs = self.prompt_graphs
        if graphs is None:
            return
        try:
            with device_scope(graphs.device), self._masked("prompt"):
                graphs.capture_all()
        except Exception:  # noqa: BLE001 - a failed capture leaves prompt passes eager, said once
            log.warning("cuda graphs: prompt passes run eagerly: %s", graphs.failed)

    def _replay_step(self, segment: Segment, batch: DecodeBatch) -> torch.Tensor | None:
        """Float32 logits ``[B, V]`` of the whole window by one graph replay, or None."""
        device = self.device_of(segment)
        if not self._graphed(segment):
            return None
        reason = why_not_fused(self.model, self.main.device)
        if device != self.main.device:
            reason = "the embedding and head live on another device than the decode layers"
        if reason is not None:
            self._say(f"no whole-step graph: {reason}")
            return None
        padded, live = self._padding.pad(batch)
        inputs = {"tokens": padded.tokens, "positions": padded.positions, "live": self._padding.live_pairs(live),
                  "tables": kv_tables(padded.sessions, segment.layers)}

        def body(static: dict[str, torch.Tensor]) -> torch.Tensor:
            hidden = self.model.embed(static["tokens"])  # [B, H]
            with self._padding.counting(self.experts.rows_for(segment.device, "decode"), static["live"]):
                hidden = self.decode_layers(segment, hidden, padded, static["positions"], static["tables"],
                                            static=True)
            return self.model.head(hidden).float()

        with device_scope(device):
            logits = self.graphs.replay(segment, padded, inputs, body, step=True, live=live)
        return None if logits is None else logits[:len(batch)]

    @property
    def graphs(self) -> DecodeGraphs:
        """The CUDA-graph cache of ``--cuda-graphs`` (created on first use)."""
        if self._graphs is None:
            self._graphs = DecodeGraphs(self.experts, max_graphs=len(BUCKETS) * (len(self._segments["decode"]) + 1))
        return self._graphs

    def why_not_graphed(self, segment: Segment) -> str | None:
        """Why ``segment``'s decode windows cannot be replayed as graphs, or None when they can."""
        if self._graphs is not None and self._graphs.failed is not None:
            return self._graphs.failed
        slot = self.devices[segment.device]
        if self._remote is not None and self._remote.remote(segment):
            return f"{slot} is another rank's device"
        if slot.device.type != "cuda":
            return f"the decode runs on {slot}, not a CUDA device"
        rows = self.experts.rows_for(segment.device, "decode")
        if not (rows.gather and rows.decoding):
            return (f"the decode gather is off on {slot} (it needs --arena pinned with every layer "
                    "pinned, --pcie-frac 1 and Triton)")
        if any(rows.chains[layer].own is None or not all(map(rows.chains[layer].computes, rows.chains[layer].peers))
               for layer in segment.layers):  # a peer computing its rows is on events only (experts/peer.py)
            return f"a layer of {slot} reads a peer's cache across or has no cache of its own"
        if self.settings.adapt_swaps or any(self.placement.adapt_swaps.values()):
            return "--adapt-swaps changes the expert cache between windows"
        if self._observers:
            return "layer observers (e.g. --dbg-nan) run host code after each layer"
        return None

    def _graphed(self, segment: Segment) -> bool:
        """Whether ``segment``'s window replays as a graph now (``--cuda-graphs`` and where it applies);
        the reason it does not is logged once."""
        if not self.settings.cuda_graphs:
            return False
        reason = self.why_not_graphed(segment)
        if reason is not None:
            self._say(reason)
        return reason is None

    def _say(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.info("cuda graphs: decode runs eagerly: %s", reason)
