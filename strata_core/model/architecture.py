"""``Architecture``: how one llama.cpp architecture's GGUF metadata and tensors map to a ModelSpec.

The class covers the llama.cpp "attention + routed MoE (+ optional shared expert)" family with
llama.cpp's tensor names. An architecture that differs only in options is an instance with other
flags (see qwen3moe.py, qwen2moe.py); one with other tensors or numbers has a ``ModelSpec`` subclass
(its ``layer_tensors``, its state) and an ``Architecture`` subclass (its ``spec_from_metadata``). The
tensor methods here read the spec's.

Defaults applied when metadata lacks a key follow llama.cpp's loader (``llama_model::load_hparams``):
- ``attention.head_count_kv`` -> ``attention.head_count``
- ``attention.key_length`` (head_dim) -> ``embedding_length / head_count``
- ``rope.freq_base`` -> 10000.0
- ``expert_feed_forward_length`` -> ``feed_forward_length / expert_used_count``
- ``expert_weights_scale`` -> 0 (llama.cpp: 0 or 1 means no scaling)
- ``expert_weights_norm`` -> the architecture's graph default (``Architecture.norm_topk_default``)
- ``context_length``: required, as llama.cpp requires it
- vocab size -> rows of ``token_embd.weight``
Every value is type- and range-checked at load (an integer key holding a string, a zero head count,
a NaN ``rms_eps``, a ``block_count`` that is not the number of ``blk.N`` layers present are each a
``ModelFileError`` naming the file and the key).
RoPE scaling (``rope.scaling.type`` linear or yarn, with ``factor``, ``original_context_length`` and
``attn_factor``) is applied as llama.cpp's ``rope_yarn`` applies it (``ModelSpec.rope_scale``).
Unsupported: per-layer head counts or expert sizes that differ between layers, another RoPE scaling
type, and ``rope.dimension_count`` != head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping

from gguf import Keys as K

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.model.kernels import ForwardKernels
from strata_core.model.metadata import Metadata, layers_present
from strata_core.model.rope import RopeScaling
from strata_core.model.spec import ModelSpec, Shape

__all__ = ["Architecture"]


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture: its name, forward options and expected tensors."""

    name: str
    has_qk_norm: bool  # attn_q_norm / attn_k_norm (RMSNorm over head_dim, before RoPE)
    has_attn_bias: bool  # attn_{q,k,v}.bias
    has_shared_expert: bool  # ffn_{gate,up,down}_shexp + sigmoid gate ffn_gate_inp_shexp
    norm_topk_default: bool  # llama.cpp graph's norm_w when expert_weights_norm is absent
    output_optional: bool  # output.weight may be absent (tied to token_embd)
    forward: Callable[..., Any]  # (spec, DenseWeights, ForwardKernels) -> the forward: MoEModel or a subclass

    # -- metadata -------------------------------------------------------------------------------
    def spec_from_metadata(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any],
                           path: str) -> ModelSpec:
        """Build the ModelSpec from GGUF metadata (with llama.cpp's defaults) and tensor shapes."""
        a = self.name
        m = Metadata(metadata, a, path)
        n_layers = m.int(K.LLM.BLOCK_COUNT)
        hidden = m.int(K.LLM.EMBEDDING_LENGTH)
        n_heads = m.int(K.Attention.HEAD_COUNT)
        n_kv = m.int(K.Attention.HEAD_COUNT_KV, n_heads)
        if n_heads % n_kv:
            raise ModelFileError(f"{path}: {a}.attention.head_count {n_heads} is not a multiple of "
                                 f"{a}.attention.head_count_kv {n_kv}")
        if K.Attention.KEY_LENGTH.format(arch=a) not in metadata and hidden % n_heads:
            raise ModelFileError(f"{path}: {a}.embedding_length {hidden} is not a multiple of "
                                 f"attention.head_count {n_heads} (and attention.key_length is absent)")
        head_dim = m.int(K.Attention.KEY_LENGTH, hidden // n_heads)
        if m.int(K.Attention.VALUE_LENGTH, head_dim) != head_dim:
            raise UnsupportedError(f"{path}: {a}.attention.value_length differs from key_length")
        if m.int(K.Rope.DIMENSION_COUNT, head_dim) != head_dim:
            raise UnsupportedError(f"{path}: partial RoPE ({a}.rope.dimension_count != head_dim) is not supported")
        rope_scale = self.read_rope_scaling(m, path)
        n_experts = m.int(K.LLM.EXPERT_COUNT)
        n_used = m.int(K.LLM.EXPERT_USED_COUNT)
        if n_used > n_experts:
            raise ModelFileError(f"{path}: bad expert counts: {a}.expert_used_count {n_used} > "
                                 f"{a}.expert_count {n_experts}")
        ffn = m.int(K.LLM.FEED_FORWARD_LENGTH, None) if K.LLM.FEED_FORWARD_LENGTH.format(arch=a) in metadata else None
        ff_exp = m.int(K.LLM.EXPERT_FEED_FORWARD_LENGTH, ffn // n_used if ffn is not None else ...)
        shexp = 0
        if self.has_shared_expert:
            shexp = m.int(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, ffn if ffn is not None else ...)
        scale = m.float(K.LLM.EXPERT_WEIGHTS_SCALE, 0.0, positive=False, below=1e3)  # released models: <= 16
        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(f"{path}: tensor 'token_embd.weight' is missing")
        if "output.weight" not in tensors and not self.output_optional:
            raise ModelFileError(f"{path}: tensor 'output.weight' is missing")
        return ModelSpec(
            architecture=a,
            n_layers=n_layers,
            hidden_size=hidden,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            n_experts=n_experts,
            n_experts_used=n_used,
            expert_ffn_size=ff_exp,
            shared_expert_ffn_size=shexp,
            vocab_size=int(embd.shape[0]),
            context_length=m.int(K.LLM.CONTEXT_LENGTH),
            rope_theta=m.float(K.Rope.FREQ_BASE, 10000.0),
            rms_norm_eps=m.float(K.Attention.LAYERNORM_RMS_EPS, below=1.0),
            norm_topk_prob=m.bool(K.LLM.EXPERT_WEIGHTS_NORM, self.norm_topk_default),
            expert_weights_scale=scale if scale != 0.0 else 1.0,
            has_qk_norm=self.has_qk_norm,
            has_attn_bias=self.has_attn_bias,
            tied_embeddings="output.weight" not in tensors,
            rope_scale=rope_scale,
        )

    def model(self, spec: ModelSpec, dense: Any, settings: Any = None) -> Any:
        """The forward of this architecture over ``dense`` (DenseWeights): ``MoEModel`` or the
        subclass with this architecture's attention or routing, running the kernels ``settings`` (a
        StrataSettings; None: the defaults) choose (``ForwardKernels``)."""
        kernels = ForwardKernels() if settings is None else ForwardKernels.from_settings(settings)
        return self.forward(spec, dense, kernels)

    def mtp_block_spec(self, spec: ModelSpec) -> ModelSpec | None:
        """The file's first next-token-prediction (MTP, llama.cpp's ``nextn``) block, ``blk.{spec.n_layers}``,
        as the spec of a one-layer model whose layer 0 is that block (what MTP drafting runs), or None when
        the file carries none this architecture runs (here: none)."""
        return None

    def read_rope_scaling(self, m: Metadata, path: str) -> RopeScaling | None:
        """The RoPE scaling the file asks for (``rope.scaling.type`` linear or yarn with a factor other
        than 1; ``original_context_length`` defaults to ``context_length``), None for none; another
        type is refused. An architecture that reads the keys into its own spec (gpt-oss) overrides this."""
        kind = m.str(K.Rope.SCALING_TYPE, "none")
        factor = m.float(K.Rope.SCALING_FACTOR, 0.0, positive=False) or 1.0
        if kind not in ("none", "linear", "yarn"):
            raise UnsupportedError(f"{path}: {self.name}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)")
        if kind == "none" or factor == 1.0:
            return None
        orig = m.int(K.Rope.SCALING_ORIG_CTX_LEN, m.int(K.LLM.CONTEXT_LENGTH), minimum=1)
        return RopeScaling(kind, factor, orig, m.float(K.Rope.SCALING_ATTN_FACTOR, 1.0))

    # -- tensors: the spec's (each architecture's ModelSpec subclass knows its own) ---------------
    def global_tensors(self, spec: ModelSpec) -> dict[str, Shape]:
        """Non-layer tensors the forward reads: name -> torch-order shape."""
        return spec.global_tensors()

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """Dense tensors of ``layer`` (attention, norms, router, shared expert): name -> shape."""
        return spec.layer_tensors(layer)

    def expert_tensors(self, spec: ModelSpec, layer: int) -> dict[str, Shape]:
        """The routed-expert tensors of ``layer`` in (gate, up, down) order: name -> shape."""
        return spec.expert_tensors(layer)

    def validate(self, gguf_file: Any, spec: ModelSpec) -> None:
        """Check the layers present match ``block_count`` and every tensor the forward reads exists with
        the right shape and a supported type."""
        present = layers_present(gguf_file.tensors)
        if len(present) != spec.n_layers or present != set(range(spec.n_layers)):
            shown = f"blk.{min(present)}..blk.{max(present)}" if present else "none"
            raise ModelFileError(f"{gguf_file.path}: {self.name}.block_count is {spec.n_layers} but the file "
                                 f"has tensors of {len(present)} layers ({shown})")
        names = dict(self.global_tensors(spec))
        for layer in range(spec.n_layers):
            names |= self.layer_tensors(spec, layer) | self.expert_tensors(spec, layer)
        for name, shape in names.items():
            gguf_file.tensor(name, shape)
