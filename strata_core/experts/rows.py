"""The one expert entry point: ``ExpertRows`` and its reference implementation.

Whoever computes a row (a cache slot, a stream, the CPU, a peer) calls ``expert_ffn`` for it and
hands the ``[T, k, H]`` rows to ``combine_rows``, which sums them in one fixed order, so the result
is bit-identical wherever each row was computed.
"""

from __future__ import annotations

from typing import Protocol

import torch
from gguf import GGMLQuantizationType

from strata_core.experts.cpu_ffn import cpu_experts_ffn, takes_cpu_kernels
from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.experts.weights import ExpertWeights
from strata_core.ops.combine import combine_rows
from strata_core.quant import quant_matmul

__all__ = ["ExpertRows", "DequantExpertRows", "expert_ffn", "group_by_expert"]

QTypes = tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType]
Shapes = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


class ExpertRows(Protocol):
    """Computes the routed-expert output of one MoE layer.

    :param layer: layer index
    :param hidden: ``[T, H]`` normed hidden states (the MoE input)
    :param expert_ids: ``[T, k]`` routed expert ids
    :param weights: ``[T, k]`` routing weights (already normalised/scaled)
    :param ffn: the layer's activation and expert biases on ``hidden``'s device (default: plain SiLU)
    :return: ``[T, H]`` = ``combine_rows(rows, weights)``
    """

    def __call__(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor, ffn: ExpertFFN = SILU) -> torch.Tensor: ...


def expert_ffn(x: torch.Tensor, gate_raw: torch.Tensor, up_raw: torch.Tensor, down_raw: torch.Tensor,
               qtypes: QTypes, shapes: Shapes, ffn: ExpertFFN = SILU, expert: int = 0) -> torch.Tensor:
    """Expert ``expert``'s gated FFN on ``x [n, H]`` from raw blocks: ``down(silu(gate x) * up x)``,
    or as ``ffn`` says (its activation, the expert's biases). On the CPU the block kernels compute it
    where they cover the formats (``cpu_experts_ffn``), else ``quant_matmul``."""
    if takes_cpu_kernels(x, qtypes, shapes):
        return cpu_experts_ffn(x, [(gate_raw, up_raw, down_raw)], [x.shape[0]], qtypes, shapes, ffn, [expert])
    g = quant_matmul(x, gate_raw, qtypes[0], shapes[0])  # [n, F]
    u = quant_matmul(x, up_raw, qtypes[1], shapes[1])  # [n, F]
    return ffn.post(quant_matmul(ffn.hidden(g, u, expert), down_raw, qtypes[2], shapes[2]), expert)  # [n, H]


def group_by_expert(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert.

    :return: ``order [T*k]`` (flat pair indices sorted by expert, stable), ``experts [n]`` (the
        distinct routed experts, ascending) and ``counts [n]`` (pairs per expert). Pair ``i`` is
        token ``i // k``, slot ``i % k``.
    """
    flat = expert_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # [n], [n]
    return order, experts, counts


class DequantExpertRows:
    """Reference ``ExpertRows``: every routed expert computed from its raw blocks with ``quant_matmul``."""

    def __init__(self, expert_weights: ExpertWeights):
        self.expert_weights = expert_weights

    def rows(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
             ffn: ExpertFFN = SILU) -> torch.Tensor:
        """``[T, k, H]``: row (t, j) is expert ``expert_ids[t, j]`` applied to token t."""
        T, k = expert_ids.shape
        out = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
        order, experts, counts = group_by_expert(expert_ids)
        start = 0
        for expert, n in zip(experts.tolist(), counts.tolist()):  # host loop: CPU reference only
            pairs = order[start:start + n]  # [n]
            b = self.expert_weights.blocks(layer, expert)
            x = hidden[pairs // k]  # [n, H]
            out[pairs] = expert_ffn(x, b.gate.to(hidden.device), b.up.to(hidden.device),
                                    b.down.to(hidden.device), b.qtypes, b.shapes, ffn, expert).to(out.dtype)
            start += n
        return out.view(T, k, -1)

    def __call__(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor, ffn: ExpertFFN = SILU) -> torch.Tensor:
        return combine_rows(self.rows(layer, hidden, expert_ids, ffn), weights)
