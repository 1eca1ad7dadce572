"""llama.cpp at the same VRAM budget: the ``--n-cpu-moe`` that fits, and the llama-bench command line.

A budget benchmark (``strata bench --vram-budget-gib X``) compares the engines at one card size.
llama.cpp with ``-ngl 99 --n-cpu-moe N`` keeps on the GPU every tensor but the token embedding and
the routed experts (``ffn_*_exps``) of layers ``0..N-1``, plus its KV cache (``-ctk``/``-ctv``: f16, or
the type ``llama_cache_type`` matches to Strata's ``--kv-type``; ``-c`` positions of each layer; a
sliding-window layer its window and one ubatch) and its compute buffers (estimated as one ubatch of
logits and activations). ``n_cpu_moe_for_budget`` is the smallest N whose estimate
fits: an estimate, so the benchmark records what llama.cpp reported when it loaded.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from strata_core.model.spec import ModelSpec

__all__ = ["LlamaCppPlacement", "llama_bench_commands", "llama_cache_type", "n_cpu_moe_for_budget"]

_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_\w+_exps\.")
#: llama-bench's ubatch in the budget commands (its compute buffers scale with it)
UBATCH = 2048
#: bytes a value of llama.cpp's KV cache types (q8_0: 32 int8 codes and an f16 scale a block)
CACHE_VALUE_BYTES = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}
#: llama.cpp's cache type for Strata's --kv-type: the same layout where it has one; for int8 and fp8 (a
#: scale per head and token, which llama.cpp has not) its one-byte type, q8_0
_CACHE_TYPES = {"auto": "f16", "bf16": "bf16", "q8_0": "q8_0", "int8": "q8_0", "fp8": "q8_0"}


def llama_cache_type(kv_type: str) -> str:
    """The llama.cpp KV cache type (``-ctk``/``-ctv``) a comparison with Strata's ``--kv-type`` uses."""
    return _CACHE_TYPES[kv_type]


@dataclass(frozen=True)
class LlamaCppPlacement:
    """llama.cpp's GPU bytes at ``--n-cpu-moe n_cpu_moe``, by part (an estimate)."""

    n_cpu_moe: int
    weights: int  # every tensor on the GPU: the dense part and the experts of layers >= n_cpu_moe
    kv: int
    buffers: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.buffers


def _kv_bytes(spec: ModelSpec, context: int, cache_type: str = "f16") -> int:
    """llama.cpp's KV cache of ``context`` positions in ``cache_type``: per-token state of every layer (a
    sliding layer's window and one ubatch), fixed-size recurrent state once (its own dtype)."""
    total = 0
    for layer in range(spec.n_layers):
        window = getattr(spec, "window", lambda _layer: None)(layer)
        positions = context if window is None else min(context, window + UBATCH)
        for t in spec.layer_state(layer).values():
            n = t.nbytes(positions, torch.float16)
            total += int(n / 2 * CACHE_VALUE_BYTES[cache_type]) if t.per_token and t.dtype is None else n
    return total


def placement_at(tensor_bytes: dict[str, int], spec: ModelSpec, n_cpu_moe: int, context: int,
                 cache_type: str = "f16") -> LlamaCppPlacement:
    """llama.cpp's GPU bytes with ``--n-cpu-moe n_cpu_moe`` for a file of ``tensor_bytes`` (name -> bytes),
    its KV cache in ``cache_type``."""
    weights = 0
    for name, n in tensor_bytes.items():
        expert_layer = _EXPERTS.match(name)
        if name.startswith("token_embd.") or (expert_layer and int(expert_layer.group(1)) < n_cpu_moe):
            continue  # in host RAM
        weights += n
    buffers = UBATCH * (spec.vocab_size + 16 * spec.hidden_size) * 4
    return LlamaCppPlacement(n_cpu_moe, weights, _kv_bytes(spec, context, cache_type), buffers)


def n_cpu_moe_for_budget(tensor_bytes: dict[str, int], spec: ModelSpec, budget: int,
                         context: int, cache_type: str = "f16") -> LlamaCppPlacement | None:
    """The placement of the smallest ``--n-cpu-moe`` whose estimate fits ``budget`` bytes, None when even
    every expert layer in host RAM does not fit."""
    layers = [int(m.group(1)) for m in map(_EXPERTS.match, tensor_bytes) if m]
    for n in range(max(layers, default=-1) + 2):
        placed = placement_at(tensor_bytes, spec, n, context, cache_type)
        if placed.total <= budget:
            return placed
    return None


def llama_bench_commands(model: Path, n_cpu_moe: int, prompts: Sequence[int], decode_tokens: int,
                         depths: Sequence[int], threads: int, cache_type: str = "f16") -> list[str]:
    """The llama-bench command lines of a budget row measuring what ``strata bench`` measures: every
    layer on the GPU but the first ``n_cpu_moe`` layers' experts, flash attention, every host core, the
    KV cache in ``cache_type`` (``-ctk``/``-ctv`` unless f16, llama.cpp's default); one
    line for prefill of each of ``prompts`` tokens (``-n 0``), one for decode of ``decode_tokens`` tokens
    after each of ``depths`` tokens of context (``-p 0 -d``); a line only where its lengths are given."""
    base = ["llama-bench", "-m", str(model), "-ngl", "99", "-ncmoe", str(n_cpu_moe), "-fa", "1",
            "-ub", str(UBATCH), "-t", str(threads)]
    if cache_type != "f16":
        base += ["-ctk", cache_type, "-ctv", cache_type]
    lines = []
    if prompts:
        lines.append(base + ["-b", str(max(UBATCH, *prompts)), "-p", ",".join(map(str, prompts)), "-n", "0"])
    if depths:
        lines.append(base + ["-p", "0", "-n", str(decode_tokens), "-d", ",".join(map(str, depths))])
    return [shlex.join(args) for args in lines]
