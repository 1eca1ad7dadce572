"""The CPU block kernels' own speed per format and instruction set: one 768 x 2048 matrix (Qwen3-30B-A3B's
gate) times one token on one thread, the matrix in cache (no DRAM), median of ``--repeats`` calls.

    python tools/cpu_kernel_isa_bench.py [--repeats 200]

Each instruction set this CPU has, capped with ``strata::cpu_kernel_limit_isa``; GB/s = quantized
bytes read. The AVX-512 and AVX2 bodies are the same lane arithmetic (the same bits), so a body much
slower than another is the compiler's code for it, not the work. The AVX-512 VNNI column is the int8
body (the activations quantized to int8 in the call, as it times them), "-" for a format without one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf.constants import GGMLQuantizationType as T

from cpu_share_bench import FF, H, layer_parts
from strata_core.ops.cpu_kernels import (CPU_INT8_TYPES, CPU_KERNEL_TYPES, INT8_ISA, ISA_NAMES, cpu_kernels,
                                         qlinear_grouped)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not cpu_kernels():
        raise SystemExit("the CPU kernels are not loaded")
    torch.set_num_threads(1)
    best = torch.ops.strata.cpu_kernel_isa()
    x = torch.randn(1, H)
    print(f"{'format':8s}" + "".join(f"{ISA_NAMES[isa]:>12s}" for isa in range(best, -1, -1)) + "   (GB/s, 1 thread, in cache)")
    try:
        for qtype in sorted(CPU_KERNEL_TYPES):
            gate = layer_parts(T(qtype), 1, pin=False)[0][0]
            rates = []
            for isa in range(best, -1, -1):
                if isa >= INT8_ISA and qtype not in CPU_INT8_TYPES:
                    rates.append(None)
                    continue
                torch.ops.strata.cpu_kernel_limit_isa(isa)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    qlinear_grouped(x, [gate], [1], qtype, FF)
                    times.append(time.perf_counter() - t0)
                rates.append(gate.numel() / statistics.median(times) / 1e9)
            print(f"{T(qtype).name:8s}" + "".join(f"{r:12.2f}" if r is not None else f"{'-':>12s}" for r in rates),
                  flush=True)
    finally:
        torch.ops.strata.cpu_kernel_limit_isa(best)


if __name__ == "__main__":
    main()
