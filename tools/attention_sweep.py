"""Time the decode attention kernel's split configurations (``_BLOCK_N``, ``_SPLITS`` of
strata_core/ops/decode.py; ``_SPLITS`` None = its rule by session count, "auto") at the Qwen3-30B-A3B
shapes and check each against the current default.

    python tools/attention_sweep.py [--contexts 1024,8192,32768] [--sessions 1,4] [--json PATH]

For each context and session count, one token's attention over 48 layers (48 distinct KV caches, as
a decode step reads them: not served from the L2) is captured in a CUDA graph per configuration and
replayed (``triton.testing.do_bench``, median); printed as us a layer, with the KV bytes read per
second. Every configuration's output must be within 1e-2 of the default's (bf16; the splits change
the summation order only). Make the winner the default: ``_BLOCK_N, _SPLITS`` in ops/decode.py.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from strata_core.ops import decode

CONFIGS = [(64, 32), (32, 16), (32, 32), (32, 64), (16, 64), (16, 128)]  # (BLOCK_N, SPLITS)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 48, 32, 4, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_sweep.json"))
    args = parser.parse_args()
    import triton

    dev = torch.device("cuda")
    default = (decode._BLOCK_N, decode._SPLITS)
    results = []
    for n in map(int, args.contexts.split(",")):
        for B in map(int, args.sessions.split(",")):
            gen = torch.Generator(device=dev).manual_seed(n + B)
            keys = [[torch.randn(n + 1, KV_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
                     for _ in range(B)] for _ in range(LAYERS)]
            values = [[torch.randn_like(k) for k in layer] for layer in keys]
            q = torch.randn(B, HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
            positions = torch.full((B,), n, dtype=torch.int64, device=dev)
            tables = [decode._device_table(k, v, dev) for k, v in zip(keys, values)]
            reference = None
            for block_n, splits in [default] + [c for c in CONFIGS if c != default]:
                decode._BLOCK_N, decode._SPLITS = block_n, splits

                def step() -> list[torch.Tensor]:
                    return [decode.decode_attention(q, positions, k, v, t) for k, v, t in zip(keys, values, tables)]

                step()  # compile
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = step()
                graph.replay()
                torch.cuda.synchronize()
                if reference is None:
                    reference = [o.clone() for o in outs]
                err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, reference))
                us = triton.testing.do_bench(graph.replay, warmup=5, rep=50) * 1e3 / LAYERS
                gbps = 2 * B * (n + 1) * KV_HEADS * HEAD_DIM * 2 / us / 1e3
                row = dict(context=n, sessions=B, block_n=block_n, splits=splits, us_per_layer=us, kv_gbps=gbps,
                           max_err=err, ok=err <= 1e-2)
                results.append(row)
                print(f"context {n:6d} B {B}: BLOCK_N {block_n:3d} SPLITS {splits or 'auto':>4}: {us:7.2f} us a layer, "
                      f"{gbps:6.0f} GB/s of KV, err {err:.1e}{'' if row['ok'] else '  WRONG'}", flush=True)
            decode._BLOCK_N, decode._SPLITS = default
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
