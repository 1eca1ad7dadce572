"""``ExpertFFN``: what one layer's experts compute beyond the plain SiLU-gated FFN.

An expert is ``down(act(gate x + bg, up x + bu)) + bd``. Qwen-style models have no biases and
``act = silu(g) * u`` (``SILU``, the default everywhere); gpt-oss has per-expert biases and
``swiglu_oai``. The biases are small dense per-layer tensors (``[E, F]``, ``[E, F]``, ``[E, H]``)
that live with the layer's dense weights on each device computing it, indexed by expert id; every
expert path (the per-expert loop, the grouped prefill, the decode gather) applies them through
``pre`` / ``glu`` / ``post`` with the ids of its rows, so the rows of one expert get the same
elementwise ops wherever they are computed (bit-identical on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata_core.ops.cpu_kernels import cpu_kernels, silu_mul_cpu
from strata_core.ops.matmul import batch_invariant

__all__ = ["ACTIVATIONS", "ExpertFFN", "SILU"]

#: The gated activations an expert FFN may use.
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class ExpertFFN:
    """The activation and optional per-expert biases of one layer's experts (on one device).

    :param activation: ``"silu"``: ``silu(g) * u``; ``"swiglu_oai"``: ``min(g, limit) *
        sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)`` (llama.cpp's
        ``ggml_swiglu_oai``, gpt-oss)
    :param gate_bias: ``[E, F]`` added to ``gate x`` (None: no bias); ``up_bias`` the same for up
    :param down_bias: ``[E, H]`` added to the expert's output
    """

    activation: str = "silu"
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.activation!r} (known: {', '.join(ACTIVATIONS)})")

    @property
    def plain(self) -> bool:
        """SiLU without biases: what the fused decode kernel computes."""
        return self.activation == "silu" and self.gate_bias is None and self.up_bias is None \
            and self.down_bias is None

    def pre(self, g: torch.Tensor, u: torch.Tensor, experts: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """``g, u [n, F]`` (the gate and up products of rows of expert(s) ``experts``: one id or ``[n]``,
        on any device) with their biases added."""
        return _biased(g, self.gate_bias, experts), _biased(u, self.up_bias, experts)

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gated activation of ``g, u [..., F]`` (on the CPU each row's value is independent of
        the row count: ``batch_invariant``; SiLU of float32 one call, ``strata::silu_mul_cpu``, where the
        CPU kernels are loaded)."""
        if self.activation == "silu":
            if g.device.type == "cpu" and g.dtype == u.dtype == torch.float32 and cpu_kernels():
                return silu_mul_cpu(g, u)
            return batch_invariant(F.silu, g) * u
        g = g.clamp(max=self.limit)
        return g * batch_invariant(torch.sigmoid, g * self.alpha) * (u.clamp(-self.limit, self.limit) + 1)

    def post(self, y: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
        """``y [n, H]`` (the down product) with the down bias of expert(s) ``experts`` added."""
        return _biased(y, self.down_bias, experts)

    def hidden(self, g: torch.Tensor, u: torch.Tensor, experts: torch.Tensor | int) -> torch.Tensor:
        """``glu(pre(g, u))``: the down product's input."""
        return self.glu(*self.pre(g, u, experts))


def _biased(y: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor | int) -> torch.Tensor:
    """``y`` plus the rows ``experts`` of ``bias`` (indexed where the bias lives, added on y's device)."""
    if bias is None:
        return y
    index = experts.to(bias.device) if isinstance(experts, torch.Tensor) else experts
    return y + bias[index].to(y.device, y.dtype)


#: The plain SiLU-gated FFN without biases.
SILU = ExpertFFN()
