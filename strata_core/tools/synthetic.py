"""Synthetic GGUF models with the real shapes of a named MoE and random but valid blocks.

``write_synthetic`` streams the file tensor by tensor (``GGUFWriter``: all tensor infos first,
then each tensor's data), so memory stays at about one expert tensor whatever the model size.
Blocks come from ``strata_core.quant.random_blocks`` (finite scales sized so activations stay
finite); to write at disk speed, each tensor is assembled from a pool of random blocks at random
offsets instead of drawing every byte from the RNG. The file carries a small byte-level BPE
tokenizer padded to the model's vocabulary, so the whole engine runs on it (a copy model's is trained
on Python code: synthetic_copy.py).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from strata_core.errors import ConfigError
from strata_core.quant import bytes_for, random_blocks
from strata_core.text.tokenizer import train_byte_level_bpe
from strata_core.text.tokenizer_meta import add_tokenizer_metadata
from strata_core.model.deepseek2.preset import DEEPSEEK_PRESETS, DeepseekPreset
from strata_core.model.gpt_oss.preset import GPT_OSS_PRESETS, GptOssPreset
from strata_core.model.preset import Preset
from strata_core.model.qwen3moe import QWEN3MOE_PRESETS
from strata_core.model.qwen3next.preset import QWEN3NEXT_PRESETS, Qwen3NextPreset
from strata_core.tools.synthetic_copy import CopyCircuit, code_tokenizer

__all__ = ["PRESETS", "Preset", "write_synthetic"]

log = logging.getLogger(__name__)


PRESETS: dict[str, Preset | DeepseekPreset | Qwen3NextPreset | GptOssPreset] = {
    **QWEN3MOE_PRESETS,
    **DEEPSEEK_PRESETS,
    **QWEN3NEXT_PRESETS,
    **GPT_OSS_PRESETS,
}

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_POOL_BLOCKS = 1 << 15


class _BlockPool:
    """Random valid blocks of one (qtype, scale), handed out as runs from random pool offsets."""

    def __init__(self, qtype: Q, scale: float, rng: np.random.Generator):
        self.blocks = random_blocks(qtype, _POOL_BLOCKS, rng, scale)  # [P, type_size]
        self.rng = rng

    def take(self, n_blocks: int) -> np.ndarray:
        out = np.empty((n_blocks, self.blocks.shape[1]), dtype=np.uint8)  # [n, type_size]
        run = _POOL_BLOCKS // 2
        for start in range(0, n_blocks, run):
            m = min(run, n_blocks - start)
            src = int(self.rng.integers(0, _POOL_BLOCKS - m + 1))
            out[start:start + m] = self.blocks[src:src + m]
        return out


def _tensors(p: Preset, expert_type: Q, dense_type: Q) -> Iterator[tuple[str, tuple[int, ...], Q, float]]:
    """(name, torch-order shape, block type, value scale) of every tensor of ``p``, in file order."""
    return p.tensors(expert_type, dense_type)


def _metadata(w: gguf.GGUFWriter, name: str, p: Preset, expert_type: Q, copy: bool) -> None:
    """The preset's metadata and a tokenizer: a toy one (320 tokens) for random weights; for a copy
    model, one trained on Python code (``code_tokenizer``), as a real model's tokenizer would cut its
    code-editing prompts."""
    w.add_name(f"strata-synthetic-{name}")
    p.add_metadata(w)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string("strata.synthetic.expert_type", expert_type.name)
    if copy:
        tok = code_tokenizer(p.vocab, _SPECIALS)
    else:
        text = ["the quick brown fox jumps over the lazy dog", "strata streams experts from host memory",
                "0123456789 hello world, a synthetic model"] * 4
        tok = train_byte_level_bpe(text, vocab_size=min(p.vocab, 320), special_tokens=_SPECIALS)
    add_tokenizer_metadata(w, tok, bos=None, eos="<|im_end|>", pad="<|endoftext|>", vocab_size=p.vocab)


def _value(qtype: Q, shape: tuple[int, ...], scale: float, rng: np.random.Generator,
           pools: dict[tuple[Q, float], _BlockPool]) -> np.ndarray:
    if qtype == Q.F32:  # norms (about 1; a negative scale: about -1) and the router
        base = math.copysign(1.0, scale) if len(shape) == 1 else 0.0
        return (base + abs(scale) * rng.standard_normal(shape, dtype=np.float32) * (0.1 if base else 1.0)).astype(np.float32)
    pool = pools.get((qtype, scale))
    if pool is None:
        pool = pools[(qtype, scale)] = _BlockPool(qtype, scale, rng)
    n_blocks = bytes_for(qtype, shape) // pool.blocks.shape[1]
    return pool.take(n_blocks).reshape(*shape[:-1], -1)


def write_synthetic(path: str | os.PathLike[str], preset: str | Preset, *, expert_type: Q | None = None,
                    dense_type: Q = Q.Q8_0, n_layers: int | None = None, seed: int = 0,
                    progress: bool = True, mtp_layers: int = 0, context: int | None = None,
                    copy: bool = False) -> int:
    """Write a synthetic model of ``preset`` to ``path``; returns the file size in bytes.

    ``expert_type`` None: the preset's ``expert_type`` if it names one (gpt-oss: MXFP4), else Q4_K.
    ``n_layers`` overrides the preset's layer count (a shorter model of the same width); ``mtp_layers``
    adds that many multi-token-prediction blocks after the layers (a preset that has them: qwen3next);
    ``context`` the context length the file declares instead of the preset's (the RoPE unchanged: as a
    model trained that long, e.g. Qwen3-30B-A3B-2507's 262,144 tokens). ``copy``: a model whose greedy
    output copies its prompt (an induction circuit, synthetic_copy.py; qwen3moe presets), a stand-in for
    a real model's tendency to repeat its prompt in speculation benchmarks, with the same tensors, block
    types, bytes and speed as the random one.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        name, preset = preset, PRESETS[preset]
    else:
        name = "custom"
    if n_layers is not None:
        preset = replace(preset, n_layers=n_layers)
    if context is not None:
        preset = replace(preset, context=context)
    if mtp_layers:
        if not hasattr(preset, "mtp_layers"):
            having = ", ".join(n for n, p in PRESETS.items() if hasattr(p, "mtp_layers"))
            raise ConfigError(f"preset {name!r} ({preset.architecture}) has no multi-token-prediction layers to "
                              f"add (presets with them: {having})")
        preset = replace(preset, mtp_layers=mtp_layers)
    if expert_type is None:
        expert_type = getattr(preset, "expert_type", Q.Q4_K)
    rng = np.random.default_rng(seed)
    circuit = CopyCircuit(preset, dense_type, seed) if copy else None
    specs = list(_tensors(preset, expert_type, dense_type))
    w = gguf.GGUFWriter(os.fspath(path), preset.architecture)
    _metadata(w, name, preset, expert_type, copy)
    total = 0
    for tname, shape, qtype, _scale in specs:
        if qtype == Q.F32:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * math.prod(shape))
            total += 4 * math.prod(shape)
        else:
            nbytes = bytes_for(qtype, shape)
            w.add_tensor_info(tname, (*shape[:-1], nbytes // math.prod(shape[:-1])), np.dtype(np.uint8), nbytes,
                              raw_dtype=qtype)
            total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pools: dict[tuple[Q, float], _BlockPool] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.fspath(path)}", disable=not progress) as bar:
        for tname, shape, qtype, scale in specs:
            data = _value(qtype, shape, scale, rng, pools)
            if circuit is not None:
                data = circuit.value(tname, shape, qtype, data)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
    w.close()
    size = os.path.getsize(path)
    log.info("synthetic %s (%d layers, %s experts): %.2f GiB", name, preset.n_layers, expert_type.name,
             size / (1 << 30))
    return size
