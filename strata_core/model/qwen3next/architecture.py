"""qwen3next (Qwen3-Next-80B-A3B): Gated DeltaNet linear-attention layers and gated full-attention
layers, every layer followed by routed experts plus a sigmoid-gated shared expert.

llama.cpp semantics (src/models/qwen3next.cpp, src/models/delta-net-base.cpp, llama-model.cpp, the
converter's ``Qwen3NextModel`` in conversion/qwen.py):

- layer ``il`` is a Gated DeltaNet ("recurrent") layer when ``attention.recurrent_layers`` (a
  per-layer bool array) says so, else when ``(il + 1) % full_attention_interval != 0`` (interval
  default 4): layers 3, 7, 11... are full attention;
- ``nextn_predict_layers`` trailing blocks are the multi-token-prediction head (``block_count`` counts
  them): never run by the main graph; ``--spec mtp`` drafts with the first (model/mtp.py: its
  ``nextn.*`` tensors and a gated full-attention layer with experts);
- full attention: ``attn_q`` projects to ``[n_heads, 2 * head_dim]`` per token, the first half the
  query and the second a gate: the attention output is multiplied by ``sigmoid(gate)`` before
  ``attn_output``; q/k RMSNorm over head_dim, then NEOX RoPE over the first
  ``rope.dimension_count`` dims of each head (Qwen3-Next: a quarter), the rest passes through;
- Gated DeltaNet (``ssm.*`` keys: ``group_count`` key heads, ``time_step_rank`` value heads,
  ``state_size`` key head dim, ``inner_size`` = value heads x value head dim, ``conv_kernel``):
  ``attn_qkv`` -> a depthwise causal convolution (``ssm_conv1d``, kernel ``conv_kernel`` over the
  previous ``conv_kernel - 1`` inputs, the *conv state*) -> SiLU -> q, k, v; q and k L2-normed
  (``x / sqrt(sum x^2 + rms_eps)``) and repeated per value head (value head j reads key head
  ``j // (v_heads / k_heads)``); ``ssm_ba`` gives per key head ``[beta x r, alpha x r]``;
  ``beta = sigmoid(b)``, log decay ``g = softplus(alpha + ssm_dt.bias) * ssm_a`` (``ssm_a`` is
  ``-exp(A_log)``, converted); the delta rule over the per-head ``[k_dim, v_dim]`` *ssm state*
  ``S``: ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(k_dim)``; then
  ``rms_norm(o, ssm_norm) * silu(attn_gate x)`` and ``ssm_out``;
- norms: the converter adds 1 to the zero-centred HF norms, so every norm is a plain RMSNorm;
  ``post_attention_norm`` is the MoE block's norm;
- MoE: softmax router, top-k, weights always renormalised (``norm_w`` true), the shared expert
  scaled by ``sigmoid(ffn_gate_inp_shexp . x)``; ``output.weight`` may be absent (tied).
The legacy ``ssm_in`` layout (one fused qkvz projection) is not supported: reconvert the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.model.architecture import Architecture
from strata_core.model.metadata import Metadata, layers_present
from strata_core.model.qwen3next.forward import Qwen3NextModel
from strata_core.model.qwen3next.spec import Qwen3NextSpec
from strata_core.model.spec import ModelSpec

__all__ = ["ARCH", "Qwen3NextArchitecture"]

RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
#: llama.cpp's default when neither recurrent_layers nor full_attention_interval is in the file
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def _recurrent_layers(metadata: Mapping[str, Any], m: Metadata, arch: str, n_all: int, n_layers: int,
                      path: str) -> tuple[bool, ...]:
    """llama.cpp's ``is_recr``: the per-layer bool array (``n_all`` entries, the MTP blocks included),
    else every layer but each ``full_attention_interval``-th."""
    key = RECURRENT_LAYERS.format(arch=arch)
    if key in metadata:
        value = metadata[key]
        if not isinstance(value, list) or len(value) != n_all or not all(isinstance(v, bool) for v in value):
            raise ModelFileError(f"{path}: metadata key {key!r} must be {n_all} booleans, got {value!r:.80}")
        return tuple(value[:n_layers])
    interval = m.int(K.LLM.FULL_ATTENTION_INTERVAL, DEFAULT_FULL_ATTENTION_INTERVAL)
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


@dataclass(frozen=True)
class Qwen3NextArchitecture(Architecture):
    """qwen3next: the base's routed + shared experts, two kinds of token mixer (see the module doc)."""

    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> Qwen3NextSpec:
        """The base spec (its partial-RoPE check skipped: read here) plus the layer pattern and the
        Gated DeltaNet shapes; ``n_layers`` excludes the MTP blocks."""
        a = self.name
        rope_key = K.Rope.DIMENSION_COUNT.format(arch=a)
        base = super().spec_from_metadata({k: v for k, v in metadata.items() if k != rope_key}, tensors, path)
        m = Metadata(metadata, a, path)
        rope_dim = m.int(K.Rope.DIMENSION_COUNT, base.head_dim)
        if rope_dim > base.head_dim or rope_dim % 2:
            raise ModelFileError(f"{path}: {rope_key} is {rope_dim}, expected an even number <= head_dim "
                                 f"{base.head_dim}")
        mtp = m.int(K.LLM.NEXTN_PREDICT_LAYERS, 0, minimum=0)
        n_layers = base.n_layers - mtp
        if n_layers < 1:
            raise ModelFileError(f"{path}: {a}.nextn_predict_layers {mtp} leaves no layers of {base.n_layers}")
        k_heads, v_heads = m.int(K.SSM.GROUP_COUNT), m.int(K.SSM.TIME_STEP_RANK)
        head_dim, inner = m.int(K.SSM.STATE_SIZE), m.int(K.SSM.INNER_SIZE)
        if v_heads % k_heads:
            raise ModelFileError(f"{path}: {a}.ssm.time_step_rank {v_heads} (value heads) is not a multiple of "
                                 f"{a}.ssm.group_count {k_heads} (key heads)")
        if inner != v_heads * head_dim:
            raise UnsupportedError(f"{path}: {a}.ssm.inner_size {inner} != value heads {v_heads} x state_size "
                                   f"{head_dim} (value head dim != key head dim is not supported)")
        return Qwen3NextSpec(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)} | {"n_layers": n_layers},
            recurrent=_recurrent_layers(metadata, m, a, base.n_layers, n_layers, path),
            rope_dim=rope_dim,
            conv_kernel=m.int(K.SSM.CONV_KERNEL, minimum=2),
            gdn_k_heads=k_heads,
            gdn_v_heads=v_heads,
            gdn_head_dim=head_dim,
            mtp_layers=mtp,
        )

    def mtp_block_spec(self, spec: ModelSpec) -> ModelSpec | None:
        """The first MTP block: a gated full-attention layer with routed and shared experts (None when the
        file has no ``nextn_predict_layers``)."""
        assert isinstance(spec, Qwen3NextSpec)
        if not spec.mtp_layers:
            return None
        return dataclasses.replace(spec, n_layers=1, recurrent=(False,), mtp_layers=0)

    def validate(self, gguf_file: Any, spec: ModelSpec) -> None:
        """The base checks over the layers that run; the MTP blocks only need to be present; a legacy
        fused ``ssm_in`` file is refused with advice."""
        assert isinstance(spec, Qwen3NextSpec)
        present = layers_present(gguf_file.tensors)
        n_all = spec.n_layers + spec.mtp_layers
        if present != set(range(n_all)):
            raise ModelFileError(f"{gguf_file.path}: {self.name}.block_count is {n_all} but the file has "
                                 f"tensors of layers {sorted(present)[:4]}...")
        legacy = [i for i in range(spec.n_layers) if spec.recurrent[i] and f"blk.{i}.ssm_in.weight" in gguf_file.tensors]
        if legacy:
            raise UnsupportedError(f"{gguf_file.path}: layer {legacy[0]} has the legacy fused 'ssm_in' projection; "
                                   "reconvert the model with a current llama.cpp convert_hf_to_gguf.py")
        super().validate(_RunLayers(gguf_file, spec.n_layers), spec)


class _RunLayers:
    """A GGUF file seen through only its first ``n_layers`` blocks (the MTP blocks hidden)."""

    def __init__(self, gguf_file: Any, n_layers: int) -> None:
        self.path = gguf_file.path
        self.tensor = gguf_file.tensor
        self.tensors = {name: t for name, t in gguf_file.tensors.items()
                        if not name.startswith("blk.") or int(name.split(".")[1]) < n_layers}


ARCH = Qwen3NextArchitecture(name="qwen3next", has_qk_norm=True, has_attn_bias=False, has_shared_expert=True,
                             norm_topk_default=True, output_optional=True,
                             forward=Qwen3NextModel)
