"""``--batch-invariant`` in the runtime: how decode windows launch their kernels under it.

The fused decode layers (model/fused_decode.py) take their dense products and attention split from
``ForwardKernels.batch_invariant``. The other layers' dense products run with their rows padded to one
cuBLAS shape (``ops.matmul.invariant_rows``), their attention row by row over the whole KV capacity
(``Runner.decode_layers``). The MoE kernels choose their design by the window's pair count, so under it
every window takes one design whatever its pairs: not the grouped one, and the q8 one (whose rows do not
depend on the other pairs) down to one pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from strata_core.ops import moe
from strata_core.ops.matmul import invariant_rows

__all__ = ["decode_launches"]


@contextmanager
def decode_launches(batch_invariant: bool) -> Iterator[None]:
    """How a decode window launches its kernels: with ``batch_invariant`` one per-pair MoE design for every
    window (its pairs combined by the same launch whatever their number) and dense products of padded rows,
    else the default choices."""
    if not batch_invariant:
        yield
        return
    with moe.launched_with(dataclasses.replace(moe.launch_config(), grouped=False, q8_pairs=1)), invariant_rows():
        yield
