"""What the dense part of a model will take on each device, computed before anything is loaded."""

from __future__ import annotations

import math

import torch

from strata_core.gguf.arch import get_architecture
from strata_core.gguf.spec import ModelSpec
from strata_core.topology import TopologyPlan


def dense_bytes_per_device(spec: ModelSpec, plan: TopologyPlan, dtype: torch.dtype, kv_tokens: int) -> dict[torch.device, int]:
    """Bytes of dequantized dense weights plus one session's KV cache (``kv_tokens`` positions)
    on each device of ``plan``: the embedding and head on the main device, each layer on its stage."""
    arch = get_architecture(spec.architecture)
    item = torch.empty((), dtype=dtype).element_size()
    sizes: dict[torch.device, int] = dict.fromkeys(plan.devices, 0)
    sizes[plan.main] += sum(math.prod(shape) for shape in arch.global_tensors(spec).values()) * item
    kv_per_layer = 2 * kv_tokens * spec.n_kv_heads * spec.head_dim * item
    for stage in plan.stages:
        for layer in stage.layers:
            weights = sum(math.prod(shape) for shape in arch.layer_tensors(spec, layer).values())
            sizes[stage.device] += weights * item + kv_per_layer
    return sizes
