"""The Strata plugin contract: every hook a strategy or observer can implement.

Hooks are grouped by lifecycle phase. The engine calls them between phases, never inside a captured
CUDA graph or a compiled region. ``firstresult`` hooks stop at the first non-None answer; selecting a
strategy blocks the other strategies, so each phase hook has exactly one strategy answer. Observers
wrap phase hooks with ``@hookimpl(wrapper=True)`` and must return what they receive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy
import torch

from strata_core.plugin import PROJECT_NAME

if TYPE_CHECKING:
    from strata_core.config import StrataSettings
    from strata_core.engine import Engine
    from strata_core.gguf.spec import ModelSpec
    from strata_core.plugin import StrategyOptions, StrategySpec
    from strata_core.residency_events import ResidencyEvent
    from strata_core.session import DecodeBatch, Session
    from strata_core.topology import TopologyPlan

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
    devices: list[torch.device],
    spec: ModelSpec,
    settings: StrataSettings,
    options: StrategyOptions,
) -> TopologyPlan | None:
    """Plan the topology: which device owns which layers, which devices are expert tiers.

    :param devices: the devices of ``--devices`` in order, validated to exist.
    :param spec: the model's architecture parameters.
    :param settings: all settings.
    :param options: the selected strategy's validated options.
    :return: the plan (first non-None result wins).

    Invariant: the stages cover every layer exactly once, in order (the engine validates it); a
    device or budget the plan cannot use is a ConfigError/BudgetError raised here, before any
    weight is loaded.
    """


# --- phases ---------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def strata_prefill(engine: Engine, session: Session, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor | None:
    """Run one prompt chunk through every layer, writing its K/V into the session's cache.

    The engine commits the chunk (``session.kv.advance``, ``session.tokens``) after the hook.

    :param engine: the engine (model, plan, expert backends, sessions helpers).
    :param session: the session being extended; its KV holds ``session.n_tokens`` positions.
    :param tokens: int64 ``[T]`` token ids of this chunk (T <= ``--prefill-chunk``).
    :param all_logits: return the logits of every position, not only the last.
    :return: float32 logits ``[T, vocab]`` if ``all_logits`` else ``[1, vocab]``, on the main device.

    Invariants: the session's KV of every layer lives on the device that owns the layer when the
    hook returns; any residency entries masked for the phase are restored before returning, also
    when it raises; logits equal ``single``'s bit for bit on the CPU with the same resident experts.
    """


@hookspec(firstresult=True)
def strata_decode_window(engine: Engine, batch: DecodeBatch) -> torch.Tensor | None:
    """Run one decode window: one new token for every session of the batch.

    :param engine: the engine.
    :param batch: the sessions and the token each appends (``batch.sessions``, ``batch.tokens``).
    :return: float32 logits ``[len(batch), vocab]`` on the main device, in batch order.

    Invariant: no host synchronisation per layer on the device path (enqueue ahead, devices wait
    on events); each session's K/V is written at exactly one new position (the engine commits it).
    """


@hookspec
def strata_residency(engine: Engine, event: ResidencyEvent) -> None:
    """Observe or act on a change of a residency table (plan, mask, restore, adapt).

    Called for every registered plugin (not firstresult), after the engine has applied the change.

    :param engine: the engine.
    :param event: what changed: ``event.kind`` is ``"plan"``, ``"mask"``, ``"restore"`` or
        ``"adapt"``, with the device and the (layer, expert) entries concerned.
    :return: nothing.

    Invariant: compute never reads a copy of a table; a ``mask`` is always followed by a
    ``restore`` of the same entries before the next phase.
    """


@hookspec(firstresult=True)
def strata_hand_off(
    engine: Engine,
    session: Session,
    layers: range,
    src: torch.device,
    dst: torch.device,
) -> bool | None:
    """Move a session's per-layer state (KV cache of ``layers``) from ``src`` to ``dst``.

    :param engine: the engine.
    :param session: the session whose state moves.
    :param layers: the layers whose state moves.
    :param src: where the state is now.
    :param dst: where it must be after the call.
    :return: True once moved (first non-None result wins).

    Invariant: after the call the state on ``dst`` is bit-identical to what was on ``src``.
    """
