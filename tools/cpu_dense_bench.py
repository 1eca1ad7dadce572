"""Dense products on the CPU: ``strata::qlinear_grouped`` on a matrix's GGUF blocks against the float32
``linear`` (rows padded to 16) on its dequantized copy, the two ways a CPU device could multiply a dense
weight.

    python tools/cpu_dense_bench.py [--qtype Q8_0] [--shapes 2048x4096,512x4096,151936x2048] [--tokens 1,16,64]

Shapes are ``OUTxIN``. Each product is timed as the best of ``--repeats`` calls after one warm-up, on
``torch.get_num_threads()`` threads; printed with the speedup of the kernel (float32 ms / kernel ms),
the kernel's GB/s of block bytes, and the largest difference of the two outputs. Needs the CPU kernels
(``cpu_kernels()``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from strata_core.ops.cpu_kernels import cpu_kernels, qlinear_grouped
from strata_core.ops.matmul import linear
from strata_core.quant import dequantize, random_blocks


def best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn`` after one warm-up, in milliseconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", default="Q8_0")
    parser.add_argument("--shapes", default="2048x4096,4096x2048,512x4096,512x512,128x512,4096x512,151936x2048")
    parser.add_argument("--tokens", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not cpu_kernels():
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    qtype = T[args.qtype]
    values, _ = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    print(f"{args.qtype}, {torch.get_num_threads()} threads")
    print("| shape (out x in) | tokens | float32 ms | kernel ms | speedup | kernel GB/s | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        out, k = (int(v) for v in shape.split("x"))
        blocks = torch.from_numpy(random_blocks(qtype, out * k // values, rng, 0.05).reshape(-1))
        weight = dequantize(blocks, qtype, (out, k)).reshape(out, k).float().contiguous()  # [out, in]
        repeats = max(3, min(10 * args.repeats, args.repeats * 4096 * 2048 // (out * k)))  # small: more calls
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, k)
            dense = best_ms(partial(linear, x, weight), repeats)
            kernel = best_ms(partial(qlinear_grouped, x, [blocks], [n], qtype, out), repeats)
            diff = (linear(x, weight) - qlinear_grouped(x, [blocks], [n], qtype, out)).abs().max().item()
            print(f"| {out} x {k} | {n} | {dense:.3f} | {kernel:.3f} | {dense / kernel:.2f} | "
                  f"{blocks.numel() / kernel / 1e6:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
