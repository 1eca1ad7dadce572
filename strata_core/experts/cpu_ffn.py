"""``cpu_experts_ffn``: the gated FFN of several experts on the CPU through the block kernels;
``cpu_slot_ffn``: the same per (token, k) pair, every expert a row of one buffer (a cache's slots).

Every CPU expert path computes its rows here where the kernels cover the layer's formats
(:func:`takes_cpu_kernels`): the loop per expert (``expert_ffn``), a CPU device's resident experts of a
layer in one call, the CPU share of decode misses, and the per-pair gather (``pair_ffn_reference``).
Each row is computed by the same arithmetic whichever group it is in (ops/cpu_kernels.py), and the
activation is ``ExpertFFN.glu`` (batch-invariant), so every path gives the same bits and combining
the rows in the fixed order keeps logits bit-identical across topologies on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.ops.cpu_kernels import has_cpu_kernel, qlinear_grouped, qlinear_slots, slot_ffn_cpu

if TYPE_CHECKING:
    from strata_core.experts.arena import ExpertFormat

__all__ = ["cpu_experts_ffn", "cpu_slot_ffn", "takes_cpu_kernels"]


def takes_cpu_kernels(x: torch.Tensor, qtypes: Sequence[int], shapes: Sequence[Sequence[int]]) -> bool:
    """Whether experts of ``qtypes`` / ``shapes`` (gate, up, down) on ``x`` (a CPU tensor) go through the CPU kernels."""
    return x.device.type == "cpu" and has_cpu_kernel(qtypes, shapes)


def cpu_experts_ffn(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    counts: list[int], qtypes: Sequence[int], shapes: Sequence[Sequence[int]],
                    ffn: ExpertFFN = SILU, experts: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:
    """Rows ``[N, H]`` in ``x.dtype``: segment i of ``x [N, H]`` (its next ``counts[i]`` rows) through the
    expert whose raw (gate, up, down) blocks are ``parts[i]``, ``down(act(gate x, up x))`` as ``ffn``
    says; ``experts`` (one id per segment) index ``ffn``'s biases. Each product is float32, cast to
    ``x.dtype`` as ``quant_matmul`` does."""
    (F, _), _, (H, _) = shapes
    gates, ups, downs = zip(*parts)
    N = x.shape[0]
    if qtypes[0] == qtypes[1]:  # gate and up in one call (each row's bits are its own either way)
        both = qlinear_grouped(torch.cat((x, x)), [*gates, *ups], counts + counts, qtypes[0], F)  # [2N, F]
        g, u = both[:N].to(x.dtype), both[N:].to(x.dtype)  # [N, F] each
    else:
        g = qlinear_grouped(x, list(gates), counts, qtypes[0], F).to(x.dtype)  # [N, F]
        u = qlinear_grouped(x, list(ups), counts, qtypes[1], F).to(x.dtype)  # [N, F]
    ids = None if ffn.plain else torch.repeat_interleave(torch.as_tensor(experts, dtype=torch.long),
                                                         torch.as_tensor(counts), output_size=N)  # [N]
    h = ffn.hidden(g, u, ids)  # [N, F]
    return ffn.post(qlinear_grouped(h, list(downs), counts, qtypes[2], H).to(x.dtype), ids)  # [N, H]


def cpu_slot_ffn(x: torch.Tensor, k: int, buffer: torch.Tensor, slot: torch.Tensor, fmt: ExpertFormat,
                 ffn: ExpertFFN = SILU, experts: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[P, H]`` in ``x.dtype`` of the ``P = T * k`` pairs: pair p is token ``p // k`` of ``x [T, H]``
    through the expert packed (gate|up|down) in row ``slot[p]`` (int64 ``[P]``) of ``buffer`` (uint8
    ``[S, >= fmt.total]``), as ``cpu_experts_ffn`` computes it (the same bits a row); ``experts [P]``
    index ``ffn``'s biases. Two kernel calls for the whole layer (gate and up in one where their
    formats agree), each grouping the pairs by slot; float32 SiLU without biases all in one
    (``strata::slot_ffn_cpu``: the same ops inside)."""
    (F, _), _, (H, _) = fmt.shapes
    g_bytes, u_bytes, _ = fmt.nbytes
    if ffn.plain and x.dtype == torch.float32:
        return slot_ffn_cpu(x, k, buffer, slot, (0, g_bytes, g_bytes + u_bytes), fmt.qtypes, F)  # [P, H]
    if fmt.qtypes[0] == fmt.qtypes[1]:
        both = qlinear_slots(x, k, buffer, slot, [0, g_bytes], fmt.qtypes[0], F)  # [P, 2F]
        g, u = both[:, :F], both[:, F:]
    else:
        g = qlinear_slots(x, k, buffer, slot, [0], fmt.qtypes[0], F)  # [P, F]
        u = qlinear_slots(x, k, buffer, slot, [g_bytes], fmt.qtypes[1], F)  # [P, F]
    h = ffn.hidden(g.to(x.dtype), u.to(x.dtype), experts)  # [P, F]
    return ffn.post(qlinear_slots(h, 1, buffer, slot, [g_bytes + u_bytes], fmt.qtypes[2], H).to(x.dtype),
                    experts)  # [P, H]
