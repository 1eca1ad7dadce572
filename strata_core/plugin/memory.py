"""What a topology may weigh when it places layers: a device's memory, the model's global weights."""

from __future__ import annotations

import math

import torch

from strata_core.experts.sizing import GIB, available_bytes
from strata_core.model.registry import get_architecture
from strata_core.model.spec import ModelSpec
from strata_core.plugin.placement import DeviceSlot

__all__ = ["GIB", "device_bytes", "global_weight_bytes", "slot_bytes"]


def device_bytes(device: torch.device, n_sharing: int = 1) -> int:
    """Memory the engine may use on ``device`` (a CPU's is shared by ``n_sharing`` slots)."""
    return available_bytes(device, n_sharing)


def slot_bytes(slot: DeviceSlot) -> int:
    """Memory the engine may use on ``slot``'s device: what its rank reported at join for another
    rank's slot, else asked of this machine (:func:`device_bytes`)."""
    return slot.memory if slot.memory is not None else device_bytes(slot.device)


def global_weight_bytes(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """Bytes of the embedding, output norm and head at ``dtype_bytes`` a value (they live on the main device)."""
    shapes = get_architecture(spec.architecture).global_tensors(spec).values()
    return sum(math.prod(shape) for shape in shapes) * dtype_bytes
