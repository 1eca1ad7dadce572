"""The batched sampler's cost per window: one ``sample_rows`` call (tokens to the host included)
for B rows of V logits, per parameter mix, on the CPU and on CUDA when there is one.

    python tools/bench_sampler.py [--rows 8] [--vocab 152064] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from strata_core.serving.sampling import Sampler, SamplingParams, sample_rows

CONFIGS = {
    "greedy": {"temperature": 0},
    "temperature 1": {"temperature": 1.0},
    "llama.cpp defaults (k40 p0.95 min-p0.05 rep1.1)": {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                        "min_p": 0.05, "repetition_penalty": 1.1},
    "top-p 0.9 alone": {"temperature": 1.0, "top_p": 0.9},
    "temperature 1, logprobs 5": {"temperature": 1.0, "logprobs": 5},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    history = [[random.Random(i).randrange(args.vocab) for _ in range(1000)] for i in range(args.rows)]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, B={args.rows}, V={args.vocab}")
    for name, kw in CONFIGS.items():
        line = f"{name:50s}"
        for device in devices:
            x = logits.to(device)
            samplers = [Sampler(SamplingParams(seed=i, **kw)) for i in range(args.rows)]
            rows = list(zip(samplers, history))
            for _ in range(3):
                sample_rows(x, rows)
            start = time.perf_counter()
            for _ in range(args.iters):
                sample_rows(x, rows)
            line += f"  {device} {(time.perf_counter() - start) / args.iters * 1000:8.3f} ms"
        print(line)


if __name__ == "__main__":
    main()
