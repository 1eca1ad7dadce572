"""``PhaseContext``: everything a phase hook may use, and nothing else.

The phase hooks (``strata_prefill``, ``strata_decode_window``, ``strata_residency``,
``strata_hand_off``) receive a ``ctx`` of this type: the engine's runner, seen through this
Protocol. A topology reads the placement and its options here, and composes a phase from the
runner's building blocks (``embed``, ``prefill_segment`` / ``decode_segment``, ``head``) or runs the
core's own (``run_prompt``, ``run_decode``). Observers watch layers (``observe_layers``), time the
segments (``time_stages``) and read the expert counters (``telemetry``). A plugin that reaches for
any other attribute is outside the contract; ``strata_core.testing.strict_context`` makes that
an error in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from strata_core.plugin.placement import DeviceSlot, Phase, Placement, Segment
from strata_core.plugin.spec import StrategyOptions

if TYPE_CHECKING:
    from strata_core.config import StrataSettings
    from strata_core.runtime.session import DecodeBatch, LogitsWanted, PromptBatch

__all__ = ["CONTEXT_MEMBERS", "LayerObserver", "PhaseContext", "StageTime"]

#: called with (layer index, that layer's output hidden state) after each layer of a phase
LayerObserver = Callable[[int, torch.Tensor], None]
#: (label, start, end) of one segment run: CUDA events, or ``time.perf_counter`` floats on the CPU
StageTime = tuple[str, Any, Any]


class PhaseContext(Protocol):
    """What a phase hook receives as ``ctx``: the placement, the strategy's options, the runner's
    building blocks and the observers' handles."""

    #: every device slot of ``--devices``, in order
    devices: tuple[DeviceSlot, ...]
    #: the strategy's placement, as validated at load
    placement: Placement
    #: the device slot of the embedding, the head and sampling
    main: DeviceSlot
    #: the selected strategy's validated options
    options: StrategyOptions
    #: every setting (observers read their switches here)
    settings: StrataSettings

    def segments(self, phase: Phase) -> tuple[Segment, ...]:
        """The maximal runs of consecutive layers on one device slot in ``phase``, in layer order."""

    def device_of(self, segment: Segment) -> torch.device:
        """The torch device of ``segment``'s device slot."""

    def embed(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Embeddings ``[T, H]`` of int64 ``tokens [T]``, computed on the main device, moved to ``device``."""

    def prefill_segment(self, segment: Segment, hidden: torch.Tensor, batch: PromptBatch) -> torch.Tensor:
        """A prompt batch's ``hidden [T, H]`` after ``segment``'s layers, each chunk's KV written for its session."""

    def decode_segment(self, segment: Segment, hidden: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token per session ``[B, H]`` after ``segment``'s layers (a replayed CUDA graph where it
        applies), enqueued without a host wait."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output norm and head on the main device: float32 logits ``[T, vocab]``."""

    def run_prompt(self, batch: PromptBatch, logits: LogitsWanted) -> torch.Tensor:
        """The core's prompt batch: every prompt segment in order, the head where ``logits`` asks."""

    def run_decode(self, batch: DecodeBatch) -> torch.Tensor:
        """The core's decode window: every decode segment in order, then the head."""

    def observe_layers(self, observer: LayerObserver) -> AbstractContextManager[None]:
        """Call ``observer`` after every layer while the block runs (it runs host code per layer:
        CUDA graphs step aside)."""

    def time_stages(self) -> AbstractContextManager[list[StageTime]]:
        """Record each segment run's device time while the block runs, into the list it yields."""

    @property
    def telemetry(self) -> Any:
        """The expert-residency counters (``ExpertTelemetry``: hits, misses, bytes, per device slot)."""


#: the names a plugin may read from ``ctx`` (the Protocol's members)
CONTEXT_MEMBERS: frozenset[str] = frozenset(
    name for name in (*PhaseContext.__annotations__, *vars(PhaseContext)) if not name.startswith("_"))

