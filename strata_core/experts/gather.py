"""The decode gather: one layer's expert rows found from the residency table, with no host read.

Inside a decode window (``CachedExpertRows.gather``) a layer's rows are computed per routed
(token, j) pair, P = T*k pairs, in a fixed number of device ops whatever the routing:

1. ``slot = table.mirror[layer][expert_ids]`` on the device (-1 = miss);
2. ``strata::gather_experts`` copies every pair's packed expert into ``[P, total]``: resident pairs
   from the cache's slots, missed pairs zero-copy from the layer's pinned arena buffer;
3. ``pair_ffn`` dequantizes the gathered gate/up/down blocks of all pairs at once
   (``[P, bytes] -> [P, out, in]``) and runs the SiLU-gated FFN per pair as batched products.

Exactness: every product goes through ``strata_core.ops.matmul.matmul``, which on the CPU pads the
one row of a pair to a 16-row tile, the gemm path the reference's grouped product of the same
expert takes; each output row then has the same bits as in the reference (``DequantExpertRows``),
and the dtype casts follow ``expert_ffn`` step by step.

Telemetry (``gather_counts``) is counted per layer on the device and read only in
``ExpertTelemetry.snapshot()``: pairs that hit, distinct (layer, expert) resident / read over the
link (as the host path counts them), and bytes read over the link, ``missed pairs * total`` (each
missed pair reads its own copy: the gather does not deduplicate, which would need a host read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata_core.experts.arena import ExpertFormat
from strata_core.ops.matmul import matmul
from strata_core.quant import dequantize

__all__ = ["GATHER_COUNTS", "gather_counts", "pair_ffn"]

#: The telemetry counters ``gather_counts`` returns, in order.
GATHER_COUNTS = ("expert_hits", "experts_resident", "experts_pcie", "bytes_streamed")


def _pair_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """``x [P, in]`` times pair p's own block-quantized ``W_p`` (``raw [P, bytes]``, ``shape == (out, in)``)
    transposed -> ``[P, out]``, computed in float32 and returned in ``x.dtype`` like ``quant_matmul``."""
    weight = dequantize(raw, qtype, (raw.shape[0], *shape))  # [P, out, in] float32
    return matmul(x.float()[:, None, :], weight.transpose(1, 2))[:, 0].to(x.dtype)  # [P, out]


def pair_ffn(x: torch.Tensor, packed: torch.Tensor, fmt: ExpertFormat) -> torch.Tensor:
    """Rows ``[P, H]``: pair p's expert (packed bytes ``packed[p]``, ``[P, >= total]``) on ``x[p]`` (``[P, H]``),
    ``down(silu(gate x) * up x)``."""
    gate, up, down = fmt.split(packed)  # [P, g], [P, u], [P, d]
    g = _pair_linear(x, gate, fmt.qtypes[0], fmt.shapes[0])  # [P, F]
    u = _pair_linear(x, up, fmt.qtypes[1], fmt.shapes[1])  # [P, F]
    return _pair_linear(F.silu(g) * u, down, fmt.qtypes[2], fmt.shapes[2])  # [P, H]


def gather_counts(slot: torch.Tensor, expert: torch.Tensor, resident: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``GATHER_COUNTS`` of one layer as int64 ``[4]`` on the device.

    :param slot: ``[P]`` slot of each pair's expert, -1 = miss
    :param expert: ``[P]`` expert of each pair
    :param resident: ``[E]`` the layer's row of the residency mirror
    :param nbytes: packed bytes of one expert of the layer
    """
    hit = slot >= 0  # [P]
    routed = torch.zeros_like(resident, dtype=torch.bool).index_fill_(0, expert, True)  # [E]
    in_slot = resident >= 0  # [E]
    return torch.stack([hit.sum(), (routed & in_slot).sum(), (routed & ~in_slot).sum(), (~hit).sum() * nbytes])
