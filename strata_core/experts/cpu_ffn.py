"""``cpu_experts_ffn``: the gated FFN of several experts on the CPU through the block kernels.

Every CPU expert path computes its rows here where the kernels cover the layer's formats
(:func:`takes_cpu_kernels`): the loop per expert (``expert_ffn``), a CPU device's resident experts of a
layer in one call, the CPU share of decode misses, and the per-pair gather (``pair_ffn_reference``).
Each row is computed by the same arithmetic whichever group it is in (ops/cpu_kernels.py), and the
activation is ``ExpertFFN.glu`` (batch-invariant), so every path gives the same bits and combining
the rows in the fixed order keeps logits bit-identical across topologies on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata_core.experts.ffn import SILU, ExpertFFN
from strata_core.ops.cpu_kernels import has_cpu_kernel, qlinear_grouped

__all__ = ["cpu_experts_ffn", "takes_cpu_kernels"]


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
