"""``--batch-invariant`` in the runtime: where it applies, and how decode windows launch the MoE under it.

The fused decode layers (model/fused_decode.py) take its dense products and attention split from
``ForwardKernels.batch_invariant``; the MoE kernels choose their design by the window's pair count,
so under it every window takes one design whatever its pairs: not the grouped one, and the q8 one
(whose rows do not depend on the other pairs) down to one pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from strata_core.errors import ConfigError
from strata_core.model.fused_decode import why_not_fused
from strata_core.ops import moe

__all__ = ["check_batch_invariant", "moe_launches"]


def check_batch_invariant(model, decode_devices: Iterable[tuple[str, torch.device]]) -> None:
    """ConfigError unless every CUDA device of ``decode_devices`` (``(slot name, device)`` of each decode
    segment) takes the fused layers, the path ``--batch-invariant`` makes batch-invariant (the CPU is
    so always)."""
    for name, device in decode_devices:
        reason = why_not_fused(model, device) if device.type == "cuda" else None
        if reason is not None:
            raise ConfigError(f"--batch-invariant covers the fused decode layers, and {reason} on {name}; "
                              "run without it")


def moe_launches(batch_invariant: bool) -> AbstractContextManager:
    """How decode windows launch the MoE kernels: with ``batch_invariant`` one per-pair design for every
    window (its pairs combined by the same launch whatever their number), else the default choice."""
    if not batch_invariant:
        return nullcontext()
    return moe.launched_with(dataclasses.replace(moe.launch_config(), grouped=False, q8_pairs=1))
