"""Time the decode attention kernel's split configurations (``_BLOCK_N``, ``_SPLITS`` of
strata_core/ops/decode.py; ``_SPLITS`` None = its rule by session count, "auto") at the Qwen3-30B-A3B
shapes and check each against the current default.

    python tools/attention_sweep.py [--contexts 1024,8192,32768] [--sessions 1,4] [--json PATH]

For each context and session count, one token's attention over 48 layers (48 distinct KV caches, as
a decode step reads them: not served from the L2) is captured in a CUDA graph per configuration and
replayed (``triton.testing.do_bench``, median); printed as us a layer, with the KV bytes read per
second. Every configuration's output must be within 1e-2 of the default's (bf16; the splits change
the summation order only). Make the winner the default: ``_BLOCK_N, _SPLITS`` in ops/decode.py.

``--kv-types bf16,q8_0,int8``: also the quantized KV kernel (``strata::decode_attention_q``, paged pools of
16-token blocks): both ways of loading its scales (``GROUPED_SCALES`` of ops/decode_q.py) and the
splits of ``Q_CONFIGS``, each checked against the first; GB/s counts the codes and scales read.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from strata_core.ops import decode

CONFIGS = [(64, 32), (32, 16), (32, 32), (32, 64), (16, 64), (16, 128)]  # (BLOCK_N, SPLITS)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 48, 32, 4, 128
#: the quantized kernel's (GROUPED_SCALES, BLOCK_N, SPLITS) tried beside its default (SPLITS 0: the rule)
Q_CONFIGS = [(True, 64, 0), (True, 32, 128), (True, 64, 128), (True, 16, 128), (True, 32, 256), (True, 64, 256)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--kv-types", default="bf16", help="bf16 and / or quantized KV types (q8_0, int8)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_sweep.json"))
    args = parser.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())  # an index: the kernels check their tensors' device
    default = (decode._BLOCK_N, decode._SPLITS)
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

                us, outs, reference = _time_graph(step, reference)
                err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, reference))
                gbps = 2 * B * (n + 1) * KV_HEADS * HEAD_DIM * 2 / us / 1e3
                row = dict(context=n, sessions=B, block_n=block_n, splits=splits, us_per_layer=us, kv_gbps=gbps,
                           max_err=err, ok=err <= 1e-2)
                results.append(row)
                print(f"context {n:6d} B {B}: BLOCK_N {block_n:3d} SPLITS {splits or 'auto':>4}: {us:7.2f} us a layer, "
                      f"{gbps:6.0f} GB/s of KV, err {err:.1e}{'' if row['ok'] else '  WRONG'}", flush=True)
            decode._BLOCK_N, decode._SPLITS = default
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
    """Time ``decode_attention_q`` over ``n + 1`` positions of ``B`` sessions' paged ``kv_type`` pools, each
    way of loading scales, in a CUDA graph over 48 layers; each checked against the first."""
    from strata_core.model.kvquant import kv_format, quantize
    from strata_core.ops import decode_q

    fmt, bs = kv_format(kv_type), 16
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
    rows, reference, default = [], None, (decode_q.GROUPED_SCALES, decode_q._BLOCK_N)
    for grouped, block_n, splits in [(*default, 0), (not default[0], default[1], 0)] + Q_CONFIGS:
        decode_q.GROUPED_SCALES, decode_q._BLOCK_N = grouped, block_n

        def step() -> list[torch.Tensor]:
            return [decode_q.decode_attention_q(q, positions, *pools, block_table, table, splits)
                    for pools, table in layers]

        us, outs, reference = _time_graph(step, reference)
        err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, reference))
        row = dict(context=n, sessions=B, kv_type=kv_type, grouped_scales=grouped, block_n=block_n, splits=splits,
                   us_per_layer=us, kv_gbps=nbytes / us / 1e3, max_err=err, ok=err <= 1e-2)
        rows.append(row)
        print(f"context {n:6d} B {B}: {kv_type} scales {'grouped' if grouped else 'per value'} BLOCK_N {block_n:3d} "
              f"SPLITS {splits or 'auto':>4}: {us:7.2f} us a layer, {row['kv_gbps']:6.0f} GB/s of KV, "
              f"err {err:.1e}{'' if row['ok'] else '  WRONG'}", flush=True)
    decode_q.GROUPED_SCALES, decode_q._BLOCK_N = default
    return rows


if __name__ == "__main__":
    main()
