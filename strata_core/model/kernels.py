"""``ForwardKernels``: which device kernels a model's forward runs (the StrataSettings fields of the same names)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

__all__ = ["ForwardKernels"]


@dataclass(frozen=True)
class ForwardKernels:
    """The kernel choices of the forward on CUDA; the defaults are the fast ones. Each choice off runs the
    torch form the kernel replaces (what tests compare against); the CPU always runs the torch forms.

    ``fused_norms``: RMSNorm and q/k norm + RoPE as fused Triton kernels; ``device_sdpa``: attention
    through torch SDPA (else the CPU's masked matmul); ``mla_kernel``: deepseek2's MLA decode through
    ``strata::mla_attention`` (else ``mla_reference``); ``deltanet_chunked``: qwen3next's Gated DeltaNet
    prompts through fla's kernel ("fla", where fla-core imports), ``delta_rule_chunked`` ("torch") or
    token by token ("recurrent"); ``batch_invariant``: a decode row's logits do not depend on the other
    rows of its window (``--batch-invariant``: dense products padded to one row count, fixed attention
    splits, the MoE's per-pair kernels); ``kv_type``: how the KV pools store rows (``--kv-type``,
    kvquant.py; the fused decode reads ``auto`` rows and int8 / q8_0 codes, ops/decode_q.py)."""

    fused_norms: bool = True
    device_sdpa: bool = True
    mla_kernel: bool = True
    deltanet_chunked: Literal["fla", "torch", "recurrent"] = "fla"
    batch_invariant: bool = False
    kv_type: str = "auto"

    @classmethod
    def from_settings(cls, settings: object) -> ForwardKernels:
        """The choices of ``settings`` (a StrataSettings: its fields of these names)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})
