"""The core's answers to the phase hooks (``trylast``): execute the placement as it is.

Registered with every engine, so a strategy that only answers ``strata_topology`` runs with these;
a strategy implementing a phase hook answers first.
"""

from __future__ import annotations

from strata_core.model import kvtransfer
from strata_core.plugin.spec import hookimpl


@hookimpl(trylast=True)
def strata_prefill(ctx, batch, logits):
    """The batch through the prompt placement's segments, then the head where logits are wanted."""
    return ctx.run_prompt(batch, logits)


@hookimpl(trylast=True)
def strata_decode_window(ctx, batch):
    """The window through the decode placement's segments, then the head."""
    return ctx.run_decode(batch)


@hookimpl(trylast=True)
def strata_hand_off(ctx, session, layers, src, dst):
    """Copy the committed KV rows of ``layers`` from ``src`` to ``dst`` (device to device)."""
    kvtransfer.move(session.kv, layers, dst.index, dst.device)
    return True
