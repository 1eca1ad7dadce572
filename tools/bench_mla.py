"""Time the MLA decode attention (``strata::mla_attention``) against the torch form it replaces on CUDA.

    python tools/bench_mla.py [--json out.json] [--contexts 1024,32768]

DeepSeek-V3 dims (128 heads, latent 512, rope key 64, bf16), one query row at each context: the Triton
kernel (with its default blocking and a few others, for tuning: ``VARIANTS``) and ``mla_reference`` (the concat, the
``[heads, S]`` scores, softmax, the product with the latent) on the same device. Median of
``triton.testing.do_bench``; GB/s = the latent and rope rows read once. Each row states the kernel's
largest difference from the torch form.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from strata_core.ops import mla

DEV = torch.device("cuda:0")
NH, C, R = 128, 512, 64
#: (BLOCK_H, BLOCK_N, SPLITS, WARPS) tried besides the default
VARIANTS = ((16, 32, 32, 8), (32, 16, 32, 8), (16, 16, 64, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--contexts", default="1024,32768")
    args = parser.parse_args()
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(0)
    for n in (int(c) for c in args.contexts.split(",")):
        latent = torch.randn(n, C, device=DEV, generator=gen).to(torch.bfloat16)
        rope = torch.randn(n, R, device=DEV, generator=gen).to(torch.bfloat16)
        q_lat = torch.randn(NH, 1, C, device=DEV, generator=gen).to(torch.bfloat16)
        q_rope = torch.randn(NH, 1, R, device=DEV, generator=gen).to(torch.bfloat16)
        positions = torch.tensor([n - 1], device=DEV)
        call = (q_lat, q_rope, latent, rope, positions, (C + R) ** -0.5)
        nbytes = (latent.numel() + rope.numel()) * 2
        want = mla.mla_reference(*call).float()
        default = (mla.BLOCK_H, mla.BLOCK_N, mla.SPLITS, mla.WARPS)
        for config in (default, *VARIANTS):
            mla.BLOCK_H, mla.BLOCK_N, mla.SPLITS, mla.WARPS = config
            form = "kernel BLOCK_H={} BLOCK_N={} SPLITS={} WARPS={}".format(*config)
            try:
                diff = (torch.ops.strata.mla_attention(*call).float() - want).abs().max().item()
                ms = triton.testing.do_bench(lambda: torch.ops.strata.mla_attention(*call), warmup=25, rep=200,
                                             return_mode="median")
                rows.append({"context": n, "form": form, "us": ms * 1e3,
                             "GB/s": nbytes / ms / 1e6, "max_diff_vs_torch": diff})
            except Exception as e:  # a variant that does not compile (registers, shared memory) is reported
                rows.append({"context": n, "form": form, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            finally:
                mla.BLOCK_H, mla.BLOCK_N, mla.SPLITS, mla.WARPS = default
        ms = triton.testing.do_bench(lambda: mla.mla_reference(*call), warmup=25, rep=200, return_mode="median")
        rows.append({"context": n, "form": "torch form (mla_reference)", "us": ms * 1e3, "GB/s": nbytes / ms / 1e6})
    for r in rows:
        detail = r.get("error") or f"{r['us']:9.1f} us {r['GB/s']:7.0f} GB/s" + (
            f"  max |kernel - torch| {r['max_diff_vs_torch']:.1e}" if "max_diff_vs_torch" in r else "")
        print(f"MLA decode, {NH} heads, context {r['context']:>6}: {r['form']:<48} {detail}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
