"""The Strata plugin contract: every hook a strategy or observer can implement.

Hooks are grouped by lifecycle phase. The engine calls them between phases, never inside a captured
CUDA graph or a compiled region. ``firstresult`` hooks stop at the first non-None answer; selecting a
strategy blocks the other strategies, so each phase hook has exactly one strategy answer, and the
core's defaults (:mod:`strata_core.plugin.defaults`, ``trylast``) answer where the strategy does
not. Observers wrap phase hooks with ``@hookimpl(wrapper=True)`` and must return what they receive.

One request, as the core runs it: ``strata_prefill`` per prompt chunk (batched with other requests'
chunks in a server step) under the prompt placement
(entries of caches the phase does not read are masked: ``strata_residency`` ``mask``, then
``restore`` when the phase ends, also when it raises); ``strata_hand_off`` once per prompt segment
for the layers whose state lives on another device slot in the decode placement; then
``strata_decode_window`` per window under the decode placement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy
import torch

from strata_core.plugin.spec import PROJECT_NAME

if TYPE_CHECKING:
    from strata_core.config import StrataSettings
    from strata_core.model.spec import ModelSpec
    from strata_core.plugin.context import PhaseContext
    from strata_core.plugin.events import ResidencyEvent
    from strata_core.plugin.placement import DeviceSlot, Placement
    from strata_core.plugin.spec import StrategyOptions, StrategySpec
    from strata_core.runtime.session import DecodeBatch, LogitsWanted, PromptBatch, Session

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


# --- discovery ------------------------------------------------------------------------------------


@hookspec
def strata_register_strategies(register: Callable[[StrategySpec], None]) -> None:
    """Declare the strategies this plugin provides.

    Called once for every registered plugin when the plugin manager is built, before a strategy is
    selected.

    :param register: call it with one :class:`~strata_core.plugin.StrategySpec` per strategy.
    :return: nothing.

    Invariant: a strategy name is claimed by exactly one distribution; a second claim is an error
    naming both.
    """


# --- engine start ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def strata_topology(
    devices: list[DeviceSlot],
    spec: ModelSpec,
    settings: StrataSettings,
    options: StrategyOptions,
) -> Placement | None:
    """Place the model: per phase and layer, the computing device slot and the expert source chain.

    :param devices: the slots of ``--devices`` in order (``cpu,cpu`` is two slots), validated to exist.
    :param spec: the model's architecture parameters.
    :param settings: all settings.
    :param options: the selected strategy's validated options.
    :return: the :class:`~strata_core.plugin.Placement` (first non-None result wins).

    Invariant: a device or budget the placement cannot use is a ConfigError/BudgetError raised here,
    before any weight is loaded; the engine validates the placement (every layer placed in both
    phases, chains ending with the arena or the CPU) before loading.
    """


# --- phases ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def strata_prefill(ctx: PhaseContext, batch: PromptBatch, logits: LogitsWanted) -> torch.Tensor | None:
    """Run one prompt batch through every layer under the prompt placement, writing its K/V.

    A batch is one prompt chunk of each of its sessions (one session for an engine's ``prefill``,
    several when a server step starts several requests). The core default runs ``ctx.run_prompt``;
    a strategy may compose ``ctx.embed``, ``ctx.prefill_segment`` and ``ctx.head`` itself. The
    runner commits the chunks (``session.kv.advance``, ``session.tokens``) after the hook.

    :param ctx: the :class:`~strata_core.plugin.context.PhaseContext` (placement, options, the
        runner's building blocks).
    :param batch: the sessions being extended (each one's KV holds ``session.n_tokens`` positions)
        and int64 ``tokens [T]``, their chunks end to end (T <= ``--prefill-chunk``).
    :param logits: ``"all"`` positions, the ``"last"`` one of each chunk, or ``"none"`` (chunks
        that are not the last of their prompts: no head is computed).
    :return: float32 logits ``[T, vocab]``, ``[len(batch), vocab]`` or ``[0, vocab]``, on the main device.

    Invariants: each layer's KV is written on the device slot that computes it in the prompt
    placement; logits equal ``single``'s bit for bit on the CPU with the same resident experts.
    """


@hookspec(firstresult=True)
def strata_decode_window(ctx: PhaseContext, batch: DecodeBatch) -> torch.Tensor | None:
    """Run one decode window under the decode placement: one new token for every session of the batch.

    The core default runs ``ctx.run_decode``; a strategy may split the window (micro-batches
    enqueued across stages) and call ``ctx.embed``, ``ctx.decode_segment`` and ``ctx.head``.

    :param ctx: the :class:`~strata_core.plugin.context.PhaseContext`.
    :param batch: the sessions and the token each appends (``batch.sessions``, ``batch.tokens``).
    :return: float32 logits ``[len(batch), vocab]`` on the main device, in batch order.

    Invariant: no host synchronisation per layer on the device path (enqueue ahead, devices wait
    on events); each session's K/V is written at exactly one new position (the engine commits it).
    """


@hookspec
def strata_residency(ctx: PhaseContext, event: ResidencyEvent) -> None:
    """Observe a change of a device slot's residency table (plan, mask, restore, adapt).

    Called for every registered plugin (not firstresult), after the engine has applied the change.

    :param ctx: the :class:`~strata_core.plugin.context.PhaseContext`.
    :param event: what changed: ``event.kind`` is ``"plan"`` (the initial fill), ``"mask"`` (a phase
        hides entries of a cache it does not read, in place), ``"restore"`` (they come back from the
        request's record) or ``"adapt"`` (decode-time swaps), with the device slot and the
        (layer, expert) entries concerned.
    :return: nothing.

    Invariant: compute never reads a copy of a table; a ``mask`` is always followed by a
    ``restore`` of the same entries before the next phase, also when the phase raised; no two
    caches ever hold the same expert.
    """


@hookspec(firstresult=True)
def strata_hand_off(
    ctx: PhaseContext,
    session: Session,
    layers: range,
    src: DeviceSlot,
    dst: DeviceSlot,
) -> bool | None:
    """Move a session's per-layer state (the KV of ``layers``) from device slot ``src`` to ``dst``.

    Called by the engine when the prompt and decode placements keep ``layers`` on different slots:
    after a prompt segment (and back before the next one). The core default copies device to
    device (``kvtransfer.move``). With ``STRATA_DBG_HANDOFF=1`` the engine reads the destination back
    and compares it with the source after the call.

    :param ctx: the :class:`~strata_core.plugin.context.PhaseContext`.
    :param session: the session whose state moves.
    :param layers: the layers whose state moves.
    :param src: where the state is now.
    :param dst: where it must be after the call.
    :return: True once moved (first non-None result wins).

    Invariant: after the call the committed state on ``dst`` is bit-identical to what was on ``src``.
    """
