"""Write a GGUF from an HF ``Qwen3MoeForCausalLM`` / ``Qwen2MoeForCausalLM`` the way llama.cpp does.

Tensor names, layouts and metadata keys follow llama.cpp's converter (conversion/qwen.py,
``Qwen2MoeModel`` / ``Qwen3MoeModel``): no q/k permutation for qwen, fused HF ``gate_up_proj
[E, 2F, H]`` split into ``ffn_gate_exps`` (first F rows) and ``ffn_up_exps``, ``down_proj
[E, H, F]`` -> ``ffn_down_exps``; the shared-expert gate ``[1, H]`` is written as ``[H]``.
Block types: experts use ``expert_qtype``, 2-D dense matrices ``dense_qtype``; 1-D tensors (norms,
biases, the shared-expert gate) and the router ``ffn_gate_inp`` stay F32, as llama.cpp keeps them.
Beyond llama.cpp it writes ``{arch}.expert_weights_norm`` = the HF ``norm_topk_prob`` so both
routing variants round-trip (llama.cpp ignores that key for these architectures).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_core.errors import UnsupportedError
from strata_core.quant import dequantize, quantize
from strata_core.text.tokenizer_meta import add_tokenizer_metadata

__all__ = ["HF_ARCHITECTURES", "write_gguf", "hf_to_gguf_tensors", "dequantized_hf_state_dict", "requantize_gguf"]

Q = GGMLQuantizationType

# HF config.model_type -> GGUF general.architecture
HF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}

_LAYER_NAMES = {  # HF suffix after "model.layers.{i}." -> GGUF suffix after "blk.{i}."
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
_FILE_TYPE = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}


def hf_to_gguf_tensors(state_dict: dict[str, torch.Tensor], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, float tensor in torch order) for every tensor of an HF Qwen MoE state dict."""
    for hf_name, t in state_dict.items():
        if hf_name in _GLOBAL_NAMES:
            if hf_name == "lm_head.weight" and tied:
                continue
            yield _GLOBAL_NAMES[hf_name], t
            continue
        parts = hf_name.split(".", 3)  # model, layers, i, rest
        if parts[:2] != ["model", "layers"]:
            raise UnsupportedError(f"HF tensor {hf_name!r} has no GGUF mapping")
        blk, rest = f"blk.{parts[2]}.", parts[3]
        if rest == "mlp.experts.gate_up_proj":  # [E, 2F, H] -> gate = first F rows, up = the rest
            n_ff = t.shape[1] // 2
            yield blk + "ffn_gate_exps.weight", t[:, :n_ff]
            yield blk + "ffn_up_exps.weight", t[:, n_ff:]
        elif rest == "mlp.shared_expert_gate.weight":
            yield blk + _LAYER_NAMES[rest], t.reshape(-1)  # [1, H] -> [H]
        elif rest in _LAYER_NAMES:
            yield blk + _LAYER_NAMES[rest], t
        else:
            raise UnsupportedError(f"HF tensor {hf_name!r} has no GGUF mapping")


def _encode(name: str, t: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Q | None]:
    """The array (and raw dtype for block formats) to hand GGUFWriter for ``t`` stored as ``qtype``."""
    arr = np.ascontiguousarray(t.detach().float().cpu().numpy())
    if qtype == Q.F32:
        return arr, None
    if qtype == Q.F16:
        return arr.astype(np.float16), None
    block = GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block:
        raise UnsupportedError(f"tensor {name!r}: row length {arr.shape[-1]} is not a multiple of "
                               f"the {qtype.name} block size {block}")
    return quantize(arr, qtype), qtype


def _qtype_for(name: str, t: torch.Tensor, expert_qtype: Q, dense_qtype: Q) -> Q:
    if t.ndim == 1 or name.endswith(_KEEP_F32):
        return Q.F32
    return expert_qtype if t.ndim == 3 else dense_qtype


def _add_metadata(w: gguf.GGUFWriter, arch: str, cfg: Any, file_type: Q) -> None:
    w.add_name(getattr(cfg, "name_or_path", "") or "strata-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    if rope.get("rope_type") in ("yarn", "linear"):  # as llama.cpp's converter writes HF's rope scaling
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(float(rope["factor"]))
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if (head_dim := getattr(cfg, "head_dim", None)) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    w.add_file_type(_FILE_TYPE.get(file_type, gguf.LlamaFileType.GUESSED))
    if file_type not in (Q.F32, Q.F16, Q.BF16):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(model: torch.nn.Module, path: str | os.PathLike[str], *,
               expert_qtype: Q = Q.F32, dense_qtype: Q = Q.F32,
               tokenizer: Any | None = None, chat_template: str | None = None,
               eos_token: str = "<|im_end|>", bos_token: str | None = None) -> None:
    """Write ``model`` (an HF Qwen3Moe/Qwen2Moe ForCausalLM) to ``path`` as llama.cpp would.

    ``tokenizer`` (a ``tokenizers.Tokenizer``) is optional; with it, tokenizer metadata is added
    by ``strata_core.text.tokenizer_meta.add_tokenizer_metadata``.
    """
    cfg = model.config
    arch = HF_ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise UnsupportedError(f"HF model_type {cfg.model_type!r} cannot be written "
                               f"(supported: {', '.join(HF_ARCHITECTURES)})")
    if list(getattr(cfg, "mlp_only_layers", []) or []) or getattr(cfg, "decoder_sparse_step", 1) != 1:
        raise UnsupportedError("dense-FFN layers (mlp_only_layers / decoder_sparse_step) are not supported")
    w = gguf.GGUFWriter(str(path), arch)
    _add_metadata(w, arch, cfg, expert_qtype)
    if tokenizer is not None:
        add_tokenizer_metadata(w, tokenizer, chat_template, bos=bos_token, eos=eos_token,
                               vocab_size=cfg.vocab_size)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in hf_to_gguf_tensors(model.state_dict(), tied):
        arr, raw_dtype = _encode(name, t, _qtype_for(name, t, expert_qtype, dense_qtype))
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_hf_state_dict(gguf_file: Any, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict shaped like ``template`` holding the GGUF file's dequantized weights.

    Loading it into the HF model gives a reference that sees exactly the weights Strata computes
    with, so quantized files can be compared with a tight tolerance.
    """
    def load(name: str) -> torch.Tensor:
        ref = gguf_file.tensors[name]
        return dequantize(ref.raw(), ref.qtype, ref.shape).float()

    out = {}
    for hf_name, t in template.items():
        names = [n for n, _ in hf_to_gguf_tensors({hf_name: t}, tied=False)]
        if names == ["output.weight"] and "output.weight" not in gguf_file.tensors:
            names = ["token_embd.weight"]  # tied embeddings
        parts = [load(n) for n in names]
        merged = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # gate_up: [E, 2F, H]
        out[hf_name] = merged.reshape(t.shape)
    return out


def requantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], choose: Callable[[str], Q | None],
                    file_type: gguf.LlamaFileType | None = None,
                    encode: Callable[[np.ndarray, Q], np.ndarray] = quantize,
                    metadata: dict[str, Any] | None = None) -> None:
    """Copy the GGUF ``src`` to ``dst`` with every tensor for which ``choose(name)`` names a block type
    dequantized and re-encoded in it (``encode``: float32 ``[..., row]`` -> uint8 ``[..., row bytes]``,
    by default ``quantize``); metadata and the other tensors are copied as they are,
    ``general.file_type`` set to ``file_type`` when given and each key of ``metadata`` (one the file
    has, keeping its type) to its value. How the llama.cpp fixtures get variants the converter cannot
    write (MXFP4 experts; K-quants with ggml's own encoder)."""
    overrides = dict(metadata or {})
    if file_type is not None:
        overrides["general.file_type"] = int(file_type)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = overrides.get(field.name, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        qtype = choose(t.name)
        if qtype is None or qtype == t.tensor_type:
            raw = None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type
            w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # torch order, row length last
        values = dequantize(torch.from_numpy(np.array(t.data).view(np.uint8)), t.tensor_type, shape)
        w.add_tensor(t.name, encode(values.numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
