"""What the dense part of a model will take on each device, computed before anything is loaded."""

from __future__ import annotations

import math

import torch

from strata_core.model.kvquant import stored_layout
from strata_core.model.registry import get_architecture
from strata_core.model.spec import ModelSpec
from strata_core.plugin.placement import PHASES, DeviceSlot, Placement
from strata_core.runtime.graphs import bucket


def dense_bytes_per_device(spec: ModelSpec, placement: Placement, slots: dict[int, DeviceSlot], dtype: torch.dtype,
                           kv_tokens: int, kv_type: str = "auto", sessions: int = 1) -> dict[torch.device, int]:
    """Bytes of dequantized dense weights plus the paged KV (``kv_bytes_per_device``) on each torch
    device of ``placement``: the embedding and head on the main slot's device; a layer's weights once
    per torch device computing it (in either phase). Only the device slots in ``slots`` count (a
    process's own, where another rank holds the rest)."""
    arch = get_architecture(spec.architecture)
    item = torch.empty((), dtype=dtype).element_size()
    sizes = kv_bytes_per_device(spec, placement, slots, dtype, kv_tokens, kv_type, sessions)
    if placement.main in slots:
        sizes[slots[placement.main].device] += sum(math.prod(s) for s in arch.global_tensors(spec).values()) * item
    for layer, device in {(layer, slots[slot].device) for layer, slot in _placed(placement, slots)}:
        sizes[device] += sum(math.prod(shape) for shape in arch.layer_tensors(spec, layer).values()) * item
    return sizes


def kv_bytes_per_device(spec: ModelSpec, placement: Placement, slots: dict[int, DeviceSlot], dtype: torch.dtype,
                        kv_tokens: int, kv_type: str = "auto", sessions: int = 1) -> dict[torch.device, int]:
    """Bytes of the paged KV on each torch device of ``placement``: rows for ``kv_tokens`` positions (a
    device slot's block pool, every session's blocks together) of each layer once per device slot
    computing it (in either phase: a hand-off keeps both copies); recurrent state (one copy per session)
    ``sessions`` times (``state_copies``). ``kv_type``: how the pools store the rows (kvquant.py; a
    ConfigError where a layer's rows cannot be stored so)."""
    sizes: dict[torch.device, int] = {slots[i].device: 0 for i in placement.devices_used() if i in slots}
    for layer, slot in _placed(placement, slots):
        stored = stored_layout(spec.layer_state(layer), kv_type, f"{spec.architecture} layer {layer}: ")
        sizes[slots[slot].device] += sum(t.nbytes(kv_tokens, dtype) * (1 if t.per_token else sessions)
                                         for t in stored.values())
    return sizes


def state_copies(parallel: int, cuda_graphs: bool) -> int:
    """The most copies of a session's recurrent state a device holds: one a slot (``--parallel``), the padding
    session's, and with CUDA graphs the stand-ins of the largest bucket (runtime/stand_ins.py)."""
    return parallel + 1 + (bucket(parallel) if cuda_graphs else 0)


def _placed(placement: Placement, slots: dict[int, DeviceSlot]) -> set[tuple[int, int]]:
    """(layer, device slot) of every layer computed on one of ``slots``, in either phase."""
    return {(layer, p.device) for phase in PHASES for layer, p in enumerate(placement.layers(phase)) if p.device in slots}
