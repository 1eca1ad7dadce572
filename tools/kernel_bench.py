"""Time Strata's CUDA kernels against the paths they replace, on Qwen3-30B-A3B expert shapes.

    python tools/kernel_bench.py [--json out.json]

Rows (median of ``triton.testing.do_bench``, fresh random blocks, weights several times the L2):
- dequantize one layer's 128 Q4_K experts' gate to bf16: Triton kernel vs the torch reference
  (float32, then a cast), as GB/s of blocks read + bf16 written;
- one decode MoE layer (8 routed pairs, hidden 2048, expert FFN 768, Q4_K): ``strata::moe_pair_rows``
  with every pair resident, every pair missing (pinned arena, staged and zero-copy), against the
  decode gather it replaces (``gather_experts`` + ``pair_ffn``); GB/s = quantized bytes read;
- attention at 8K prompt (32 heads, 4 kv heads, head 128, bf16) and 1 token at 32K context:
  ``sdpa_attention`` against the masked matmul of the CPU path.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import triton.testing
from gguf.constants import GGMLQuantizationType as T

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.gather import pair_ffn
from strata_core.model.ops import sdpa_attention
from strata_core.ops import moe
from strata_core.ops.gather import gather_experts
from strata_core.ops.matmul import matmul
from strata_core.ops.qdecode import block_geometry
from strata_core.quant import dequantize, random_blocks
from strata_core.quant.registry import dequantize_reference

DEV = torch.device("cuda:0")
H, FF, E, K = 2048, 768, 128, 8


def bench(fn) -> float:
    """Median milliseconds of ``fn``."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def layer_experts(qtype: T, n: int = E) -> tuple[torch.Tensor, ExpertFormat]:
    rng = np.random.default_rng(0)
    shapes = ((FF, H), (FF, H), (H, FF))
    bs = block_geometry(qtype)[0]
    parts = [random_blocks(qtype, n * r * c // bs, rng, 0.05).reshape(n, -1) for r, c in shapes]
    fmt = ExpertFormat((qtype,) * 3, shapes, tuple(p.shape[1] for p in parts))
    return torch.from_numpy(np.concatenate(parts, axis=1)), fmt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--qtypes", default="Q4_K,Q8_0,Q6_K,IQ4_XS")
    args = parser.parse_args()
    rows: list[tuple[str, float, str]] = []

    def row(name: str, ms: float, note: str = "") -> None:
        rows.append((name, ms, note))
        print(f"{name:<72} {ms * 1e3:>10.1f} us  {note}", flush=True)

    for name in args.qtypes.split(","):
        qtype = T[name]
        arena, fmt = layer_experts(qtype)
        dev = arena.to(DEV)
        gate = fmt.split(dev)[0]  # [E, g] strided rows
        nbytes = gate.numel() + E * FF * H * 2
        ms = bench(lambda: dequantize(gate, qtype, (E, FF, H), torch.bfloat16))
        row(f"dequantize {name} 128 experts' gate -> bf16, Triton", ms, f"{nbytes / ms / 1e6:.0f} GB/s")
        if name == "Q4_K":
            ms = bench(lambda: dequantize_reference(gate, qtype, (E, FF, H)).to(torch.bfloat16))
            row(f"dequantize {name} 128 experts' gate -> bf16, torch reference", ms, f"{nbytes / ms / 1e6:.0f} GB/s")

        pinned = arena.pin_memory()
        slots = dev.clone()  # every expert in a slot
        x = torch.randn(1, H, device=DEV, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        expert = torch.randperm(E, generator=gen)[:K].to(DEV)
        hit, miss = expert.clone(), torch.full_like(expert, -1)
        read = K * fmt.total
        margs = lambda slot: (x, slots, pinned, slot, expert, K,  # noqa: E731
                              [int(q) for q in fmt.qtypes], [n for s in fmt.shapes for n in s], list(fmt.nbytes))
        ms = bench(lambda: moe.moe_pair_rows(*margs(hit)))
        row(f"decode MoE layer {name}, 8 pairs resident: moe_pair_rows", ms, f"{read / ms / 1e6:.0f} GB/s")
        for mode in ("staged", "direct"):
            ms = bench(lambda: moe.moe_pair_rows(*margs(miss), direct_misses=mode == "direct"))
            row(f"decode MoE layer {name}, 8 pairs from the pinned arena ({mode})", ms, f"{read / ms / 1e6:.1f} GB/s")
        if name == "Q4_K":
            def old(slot):
                packed = gather_experts(slots, pinned, slot, expert, fmt.total)
                return pair_ffn(x.expand(K, H), packed, fmt)
            ms = bench(lambda: old(hit))
            row(f"decode MoE layer {name}, 8 pairs resident: gather + pair_ffn (before)", ms, f"{read / ms / 1e6:.0f} GB/s")
            ms = bench(lambda: old(miss))
            row(f"decode MoE layer {name}, 8 pairs from the arena: gather + pair_ffn (before)", ms, "")
        del dev, slots, pinned, gate

    for T_, S in ((8192, 8192), (1, 32768)):
        q = torch.randn(T_, 32, 128, device=DEV, dtype=torch.bfloat16)
        keys = torch.randn(S, 4, 128, device=DEV, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        positions = torch.arange(S - T_, S, device=DEV)
        ms = bench(lambda: sdpa_attention(q, keys, values, positions))
        flops = 4 * 32 * 128 * T_ * S / (2 if T_ == S else 1)
        row(f"attention T={T_} S={S}: sdpa_attention", ms, f"{flops / ms / 1e9:.0f} TFLOP/s")

        def masked():
            k = keys.transpose(0, 1).repeat_interleave(8, dim=0)
            v = values.transpose(0, 1).repeat_interleave(8, dim=0)
            scores = matmul(q.transpose(0, 1), k.transpose(1, 2)) * 128 ** -0.5
            visible = torch.arange(S, device=DEV)[None, :] <= positions[:, None]
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")).float(), dim=-1).to(q.dtype)
            return matmul(probs, v)
        ms = bench(masked)
        row(f"attention T={T_} S={S}: masked matmul (before)", ms, "")
        del q, keys, values
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": n, "ms": ms, "note": note} for n, ms, note in rows], f, indent=1)


if __name__ == "__main__":
    main()
