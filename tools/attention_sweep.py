"""Time the decode attention kernel's split configurations (``_BLOCK_N``, ``_SPLITS``, ``_STAGES`` of
strata_core/ops/decode.py; ``_SPLITS`` None = its rule by session count, "auto") at the Qwen3-30B-A3B
shapes and check each against the current default.

    python tools/attention_sweep.py [--contexts 1024,8192,32768] [--sessions 1,4] [--json PATH]

For each context and session count, one token's attention over 48 layers (48 distinct KV caches, as
a decode step reads them: not served from the L2) is captured in a CUDA graph per configuration and
replayed (``triton.testing.do_bench``, median); printed as us a layer, with the KV bytes read per
second. Every configuration's output must be within 1e-2 of the default's (bf16; the splits change
the summation order only). The fastest configuration of each context and session count is printed last,
beside the default's time; make the winner the default: ``_BLOCK_N, _SPLITS, _STAGES`` in ops/decode.py.

``--kv-types bf16,q8_0,int8,fp8``: also the quantized KV kernel (``strata::decode_attention_q``, paged pools
of 16-token blocks): its default (``_BLOCK_N, _STAGES, _WARPS`` of ops/decode_q.py, the splits of
``_attention_splits`` up to ``_MOST_SPLITS``) and every configuration of ``Q_CONFIGS``, each checked against
the first; GB/s counts the codes and scales read. The fastest quantized configuration of each context,
session count and KV type is printed last, beside the default's time; make the winner the default in
ops/decode_q.py.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from strata_core.ops import decode

#: (BLOCK_N, SPLITS, STAGES): the split configurations at Triton's default 3 stages, then fewer stages and
#: larger tiles (BLOCK_N 128, 2 stages, 128 splits: the quantized kernel's fastest)
CONFIGS = ([(64, 32, 3), (32, 16, 3), (32, 32, 3), (32, 64, 3), (16, 64, 3), (16, 128, 3)]
           + [(32, None, 1), (32, None, 2), (64, None, 2), (64, 128, 2), (128, 64, 2), (128, 128, 2)])
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 48, 32, 4, 128
BLOCK = 16  # positions a KV block (the paged pools')
#: the quantized kernel's (BLOCK_N, SPLITS, STAGES, WARPS) tried beside its default (SPLITS 0: the rule)
Q_CONFIGS = ([(n, s, st, 4) for n in (32, 64, 128) for s in (0, 128, 256) for st in (1, 2, 3)]
             + [(32, 0, 2, 2), (64, 0, 2, 8), (128, 128, 2, 8)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--kv-types", default="bf16", help="bf16 and / or quantized KV types (q8_0, int8, fp8)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_sweep.json"))
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())  # an index: the kernels check their tensors' device
    default = (decode._BLOCK_N, decode._SPLITS, decode._STAGES)
    results = []
    kv_types = args.kv_types.split(",")
    for n in map(int, args.contexts.split(",")):
        for B in map(int, args.sessions.split(",")):
            for kv_type in kv_types:
                if kv_type != "bf16":
                    results += _sweep_quantized(n, B, kv_type, dev)
            if "bf16" not in kv_types:
                continue
            gen = torch.Generator(device=dev).manual_seed(n + B)
            per = (n + 1 + BLOCK - 1) // BLOCK
            block_table = torch.arange(B * per, dtype=torch.int32, device=dev).view(B, per)
            layers = []
            for _ in range(LAYERS):
                kp, vp = (torch.randn(B * per, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device=dev,
                                      dtype=torch.bfloat16) for _ in range(2))
                layers.append((kp, vp, decode._device_table(kp, vp, block_table, dev)))
            q = torch.randn(B, HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
            positions = torch.full((B,), n, dtype=torch.int64, device=dev)
            reference, rows = None, []
            for block_n, splits, stages in [default] + [c for c in CONFIGS if c != default]:
                decode._BLOCK_N, decode._SPLITS, decode._STAGES = block_n, splits, stages

                def step() -> list[torch.Tensor]:
                    return [decode.decode_attention(q, positions, kp, vp, block_table, table)
                            for kp, vp, table in layers]

                us, outs, reference = _time_graph(step, reference)
                err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, reference))
                gbps = 2 * B * (n + 1) * KV_HEADS * HEAD_DIM * 2 / us / 1e3
                row = dict(context=n, sessions=B, block_n=block_n, splits=splits, stages=stages, us_per_layer=us,
                           kv_gbps=gbps, max_err=err, ok=err <= 1e-2)
                rows.append(row)
                print(f"context {n:6d} B {B}: BLOCK_N {block_n:3d} SPLITS {splits or 'auto':>4} STAGES {stages}: "
                      f"{us:7.2f} us a layer, {gbps:6.0f} GB/s of KV, err {err:.1e}{'' if row['ok'] else '  WRONG'}",
                      flush=True)
            decode._BLOCK_N, decode._SPLITS, decode._STAGES = default
            results += rows
            best = min((r for r in rows if r["ok"]), key=lambda r: r["us_per_layer"])
            print(f"context {n:6d} B {B}: bf16 best: BLOCK_N {best['block_n']} SPLITS {best['splits'] or 'auto'} "
                  f"STAGES {best['stages']} {best['us_per_layer']:.2f} us a layer against the default's "
                  f"{rows[0]['us_per_layer']:.2f}", flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


def _time_graph(step, reference: list[torch.Tensor] | None) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    """``step``'s 48 layers captured in a CUDA graph (after a compiling call): (us a layer, median of
    replays; its outputs; ``reference``, or a copy of these outputs when None)."""
    import triton

    step()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    torch.cuda.synchronize()
    us = triton.testing.do_bench(graph.replay, warmup=5, rep=50) * 1e3 / LAYERS
    return us, outs, reference if reference is not None else [o.clone() for o in outs]


def _sweep_quantized(n: int, B: int, kv_type: str, dev: torch.device) -> list[dict]:
    """Time ``decode_attention_q`` over ``n + 1`` positions of ``B`` sessions' paged ``kv_type`` pools in each
    configuration, in a CUDA graph over 48 layers; each checked against the first (the default)."""
    from strata_core.model.kvquant import kv_format, quantize
    from strata_core.ops import decode_q

    fmt, bs = kv_format(kv_type), BLOCK
    per = (n + 1 + bs - 1) // bs
    gen = torch.Generator(device=dev).manual_seed(n + B)
    block_table = torch.arange(B * per, dtype=torch.int32, device=dev).view(B, per)
    layers = []
    for _ in range(LAYERS):
        (kc, ks), (vc, vs) = (quantize(torch.randn(B * per, bs, KV_HEADS, HEAD_DIM, generator=gen, device=dev,
                                                   dtype=torch.bfloat16), fmt) for _ in range(2))
        pools = (kc, vc, ks, vs)
        layers.append((pools, decode_q._device_table_q(pools, block_table, dev)))
    q = torch.randn(B, HEADS, HEAD_DIM, generator=gen, device=dev, dtype=torch.bfloat16)
    positions = torch.full((B,), n, dtype=torch.int64, device=dev)
    nbytes = sum(t.numel() * t.element_size() for t in layers[0][0]) * (n + 1) / (per * bs)
    rows, reference = [], None
    default = (decode_q._BLOCK_N, 0, decode_q._STAGES, decode_q._WARPS)
    knobs = (decode_q._BLOCK_N, decode_q._STAGES, decode_q._WARPS)
    for block_n, splits, stages, warps in [default] + [c for c in Q_CONFIGS if c != default]:
        decode_q._BLOCK_N, decode_q._STAGES, decode_q._WARPS = block_n, stages, warps

        def step() -> list[torch.Tensor]:
            return [decode_q.decode_attention_q(q, positions, *pools, block_table, table, splits)
                    for pools, table in layers]

        us, outs, reference = _time_graph(step, reference)
        err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, reference))
        row = dict(context=n, sessions=B, kv_type=kv_type, block_n=block_n,
                   splits=splits, stages=stages, warps=warps, us_per_layer=us, kv_gbps=nbytes / us / 1e3,
                   max_err=err, ok=err <= 1e-2)
        rows.append(row)
        print(f"context {n:6d} B {B}: {kv_type} BLOCK_N {block_n:3d} SPLITS {splits or 'auto':>4} STAGES {stages} WARPS {warps}: {us:7.2f} us a "
              f"layer, {row['kv_gbps']:6.0f} GB/s of KV, err {err:.1e}{'' if row['ok'] else '  WRONG'}", flush=True)
    decode_q._BLOCK_N, decode_q._STAGES, decode_q._WARPS = knobs
    best = min((r for r in rows if r["ok"]), key=lambda r: r["us_per_layer"])
    print(f"context {n:6d} B {B}: {kv_type} best: BLOCK_N {best['block_n']} SPLITS {best['splits'] or 'auto'} "
          f"STAGES {best['stages']} WARPS {best['warps']} {best['us_per_layer']:.2f} us a layer against the default's {rows[0]['us_per_layer']:.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
