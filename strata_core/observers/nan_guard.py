"""NaN guard: ``STRATA_DBG_NAN=1`` checks every layer's output and names the first non-finite one.

Wraps the phase hooks under any strategy: while a phase runs, a layer observer checks each layer's
output and raises :class:`NonFiniteError` at the first layer whose output holds NaN or inf. The check
synchronises with the device per layer, so it is a debugging aid, registered only when switched on.
"""

from __future__ import annotations

import torch

from strata_core.errors import StrataError
from strata_core.plugin import hookimpl


class NonFiniteError(StrataError):
    """A layer produced NaN or inf."""


def _guarded(ctx, phase: str):
    def check(layer: int, hidden: torch.Tensor) -> None:
        if not bool(torch.isfinite(hidden).all()):
            raise NonFiniteError(f"{phase}: layer {layer} output is non-finite (first such layer)")

    with ctx.observe_layers(check):
        return (yield)


@hookimpl(wrapper=True)
def strata_prefill(ctx, batch, logits):
    """Check every layer of a prompt batch."""
    return (yield from _guarded(ctx, "prefill"))


@hookimpl(wrapper=True)
def strata_decode_window(ctx, batch):
    """Check every layer of a decode window."""
    return (yield from _guarded(ctx, "decode"))
