"""Time the decode MoE kernels' launch configurations (``strata_core.ops.moe.LaunchConfig``) at the
Qwen3-30B-A3B shapes and check each against the CPU reference.

    python tools/moe_sweep.py [--qtypes Q4_K,Q6_K,Q8_0] [--tokens 1,4] [--budget 120] [--small]
    python tools/moe_sweep.py --grouped [--qtypes Q4_K] [--tokens 1,8,32]

For each block type and token count (top-8, every expert resident in a device slot table like the
engine's, routing rotated over disjoint expert sets so the 128 experts' weights — several times the
L2 — are not served from the L2), each variant's ``strata::moe_decode`` (gate_up + combining down
launch) is timed as a replayed CUDA graph of several calls (as the engine replays a window: no host
time between launches in the figure), and so is its gate_up launch alone. A
variant's output must be within the documented tolerance of the CPU reference (bf16: relative
Frobenius error 2e-2, ``tests/test_kernels_cuda.py``) and bit-identical over two runs
(deterministic); it is printed in a table sorted by time (us a layer, GB/s of quantized bytes read)
and written with everything else to ``$OUT/moe_sweep.json`` (or ``--json``). Every variant is compiled
first by ``--jobs`` processes at once; the sweep stops at ``--budget`` seconds, listing the variants
it did not reach as skipped. Block types other than
Q4_K get the first ``--others`` variants only.

``--grouped`` times the batch designs against the split design's per-pair kernels (what one token
takes): the q8 design (strata_core/ops/moe_q8.py, forced with ``q8_pairs=1``) and its variants, and the grouped
design (strata_core/ops/moe_grouped.py, forced with ``grouped=True, grouped_pairs=1``), on
routings like a batch's: each token's top-k distinct experts drawn at random, so tokens share experts (B=8: 64 pairs on
~50 experts; B=32: 256 on ~110). Each timed call reads another of ``--layers`` copies of the layer's
experts (as the next layer would), so no call finds the previous call's weights in the L2; the
window column is a layer's time times ``--window-layers`` (48: Qwen3-30B-A3B); the gate_up column
is the gate_up launch alone (grouped: the align and gate_up launches).

``--small`` runs small shapes on the CPU with the Triton interpreter (``TRITON_INTERPRET=1``), a check
of the tool and the kernels' logic, not a measurement.

Make the winner the default: set the fields of its ``config`` as the defaults of ``LaunchConfig`` in
strata_core/ops/moe.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.experts.arena import ExpertFormat
from strata_core.experts.ffn import SILU
from strata_core.ops import moe, moe_grouped, moe_triton
from strata_core.ops.moe_sources import weight_sources
from strata_core.ops.qdecode import block_geometry
from strata_core.quant import random_blocks

C = moe.LaunchConfig
#: The variants, the current default first; others than Q4_K get the first ``--others``.
VARIANTS: list[C] = [
    C(),
    C(design="loop", bn_gate_up=8, bn_combine=4),
    C(design="split-loop", bn_combine=4),
    C(bn_gate_up=8, bn_combine=8),
    C(bn_combine=32),
    C(bn_combine=8),
    C(bn_gate_up=2),
    C(bn_gate_up=8),
    C(split_k=2),
    C(bn_gate_up=16, split_k=2),
    C(tile=2048),
    C(tile=8192, warps_gate_up=8, warps_combine=8),
    C(warps_combine=8),
    C(warps_combine=2),
    C(bn_combine=4, tile=2048),
    C(bn_gate_up=16, warps_gate_up=8, bn_combine=2, tile=2048),
    C(fast_q4k=False),
    C(design="loop", bn_gate_up=4, bn_combine=2),
]
#: ``--grouped``: the split design first (the per-pair kernels a single token takes), then the q8 design
#: (every window q8) and its variants, then the grouped design (every window grouped)
G = dict(grouped=True, grouped_pairs=1)
Q8 = dict(design="q8", q8_pairs=1)
GROUPED_VARIANTS: list[C] = [
    C(design="split"),
    C(**Q8),
    *(C(**Q8, **f) for f in (dict(warps_q8=4), dict(tile=8192), dict(bn_gate_up=8), dict(bn_combine=8),
                             dict(bn_gate_up=2), dict(bn_combine=32), dict(bn_gate_up=8, bn_combine=32))),
    C(**G, dot_precision="bf16"),
]
TOL = 2e-2  # bf16, relative Frobenius error against the CPU reference (tests/test_kernels_cuda.py)


def layer(qtype: T, hidden: int, ffn: int, n: int) -> tuple[torch.Tensor, ExpertFormat]:
    """``n`` random packed experts ``[n, total]`` of ``qtype`` and their format (like kernel_bench)."""
    rng = np.random.default_rng(0)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    bs = block_geometry(qtype)[0]
    parts = [random_blocks(qtype, n * r * c // bs, rng, 0.05).reshape(n, -1) for r, c in shapes]
    return torch.from_numpy(np.concatenate(parts, axis=1)), ExpertFormat((qtype,) * 3, shapes,
                                                                          tuple(p.shape[1] for p in parts))


def label(cfg: C) -> str:
    """The fields of ``cfg`` that differ from the defaults (``default`` for none)."""
    base = C()
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(C)
            if getattr(cfg, f.name) != getattr(base, f.name)]
    return " ".join(diff) or "default"


def gate_up_alone(x: torch.Tensor, slots: torch.Tensor, route: torch.Tensor, topk: int, op: list) -> torch.Tensor:
    """The gate_up launch of the design the config in force picks for ``route``'s pairs (every expert
    resident: slot e holds expert e); the grouped design's align launch with it."""
    sources = weight_sources(slots, slots, route, route, sum(op[2]))
    if moe.launch_config().groups(route.shape[0]):
        return moe_grouped.grouped_gate_up(x, sources, topk, *op, SILU, slots.shape[0])[0]
    return moe_triton._gate_up(x, sources, topk, *op)


def random_routes(gen: torch.Generator, n: int, tokens: int, topk: int, experts: int) -> list[torch.Tensor]:
    """``n`` routings ``[tokens * topk]``: each token's ``topk`` distinct experts drawn at random."""
    return [torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).reshape(-1)
            for _ in range(n)]


def graph_ms(fn, calls: int, replays: int = 20) -> float:
    """Milliseconds a call of ``fn`` takes on the device: ``calls`` calls captured in one CUDA graph,
    the graph replayed ``replays`` times between two events (the median of three such timings)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return sorted(times)[1]


def _warm(qname: str, cfgs: list[C], tokens: list[int], topk: int) -> None:
    """Compile ``cfgs``' kernels for ``qname`` into Triton's disk cache (run in a worker process):
    the same launches as the sweep's on zero weights of the same shapes and alignments."""
    qtype = T[qname]
    fmt = layer(qtype, 2048, 768, 1)[1]
    op = [[int(q) for q in fmt.qtypes], [n for s in fmt.shapes for n in s], list(fmt.nbytes)]
    dev = torch.device("cuda:0")
    slots = torch.zeros((max(tokens) * topk, fmt.total), dtype=torch.uint8, device=dev)
    for cfg in cfgs:
        with moe.launched_with(cfg):
            for t in tokens:
                route = torch.arange(t * topk, device=dev)
                x = torch.zeros((t, 2048), dtype=torch.bfloat16, device=dev)
                w = torch.zeros((t, topk), dtype=torch.bfloat16, device=dev)
                moe.moe_decode(x, slots, slots, route, route, w, topk, *op)
                gate_up_alone(x, slots, route, topk, op)
    torch.cuda.synchronize()


def warm_all(plan: list[tuple[str, list[C]]], tokens: list[int], topk: int, jobs: int) -> None:
    """Compile every variant of ``plan`` in ``jobs`` worker processes at once (Triton's disk cache is
    shared, so the sweep's own launches only load them); a worker's failure is left to the sweep."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    work = [(q, [cfg]) for q, cfgs in plan for cfg in cfgs]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_warm, q, cfgs, tokens, topk) for q, cfgs in work]
        for f in futures:
            if f.exception() is not None:
                print(f"warm-up compile failed: {f.exception()!r}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtypes", default="Q4_K,Q6_K,Q8_0")
    parser.add_argument("--tokens", help="token counts (default 1,4; with --grouped 1,8,32)")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--others", type=int, default=4, help="variants timed for block types other than Q4_K")
    parser.add_argument("--budget", type=float, default=110.0, help="seconds; variants after it are skipped")
    parser.add_argument("--small", action="store_true", help="small shapes on the CPU (Triton interpreter)")
    parser.add_argument("--jobs", type=int, default=12, help="processes compiling the variants first (CUDA)")
    parser.add_argument("--grouped", action="store_true",
                        help="today's kernels against the grouped design, on random top-k routings")
    parser.add_argument("--layers", type=int, default=8, help="--grouped: copies of the layer the calls cycle over")
    parser.add_argument("--window-layers", type=int, default=48, help="MoE layers a decode window (for ms/window)")
    parser.add_argument("--json", default=str(Path(os.environ.get("OUT", ".")) / "moe_sweep.json"))
    args = parser.parse_args()
    args.tokens = args.tokens or ("1,8,32" if args.grouped else "1,4")
    small = args.small
    dev = torch.device("cpu" if small else "cuda:0")
    H, F, E = (512, 256, 32) if small else (2048, 768, 128)
    K = args.topk
    start = time.monotonic()
    rows, skipped = [], []
    variants_of = GROUPED_VARIANTS if args.grouped else VARIANTS
    plan = [(q, variants_of if T[q] == T.Q4_K else variants_of[:args.others]) for q in args.qtypes.split(",")]
    if not small:
        if args.jobs > 1:
            warm_all(plan, [int(t) for t in args.tokens.split(",")], K, args.jobs)
            print(f"compiled in {time.monotonic() - start:.0f} s", flush=True)
    for qname, variants in plan:
        qtype = T[qname]
        arena, fmt = layer(qtype, H, F, E)
        slots = arena.to(dev)  # every expert resident: slot e holds expert e
        # --grouped: the calls cycle over copies of the layer, as over the model's layers
        copies = [slots] + [slots.clone() for _ in range(args.layers - 1 if args.grouped and not small else 0)]
        op = [[int(q) for q in fmt.qtypes], [n for s in fmt.shapes for n in s], list(fmt.nbytes)]
        for tokens in map(int, args.tokens.split(",")):
            P = tokens * K
            gen = torch.Generator().manual_seed(tokens)
            x = (torch.randn(tokens, H, generator=gen) * 0.5).to(torch.bfloat16)
            weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(torch.bfloat16)
            if args.grouped:  # a batch's routings, each on its own copy of the layer's experts
                routes = random_routes(gen, len(copies), tokens, K, E)
            else:  # routings over disjoint expert sets (each pair its own expert)
                perm = torch.randperm(E, generator=gen)
                routes = [perm.roll(-i * P)[:P] for i in range(max(1, E // P))]
            calls = list(zip(itertools.cycle(copies), [r.to(dev) for r in routes]))  # cycled by the timed calls
            read = sum(r.unique().numel() for r in routes) / len(routes) * fmt.total  # routed experts' bytes
            xd, wd = x.to(dev), weights.to(dev)
            want = moe.moe_decode(x, arena, arena, routes[0], routes[0], weights, K, *op)  # CPU reference
            for cfg in variants:
                name = label(cfg)
                if time.monotonic() - start > args.budget:
                    skipped.append(f"{qname} T={tokens} {name}")
                    continue
                with moe.launched_with(cfg):
                    call = moe.moe_decode if not small else moe_triton.decode_cuda  # the CUDA kernel on CPU tensors
                    try:
                        got = call(xd, slots, slots, calls[0][1], calls[0][1], wd, K, *op)
                    except Exception as exc:  # a variant that does not compile: reported, the others go on
                        print(f"{qname} T={tokens} {name}: FAILED {exc!r}"[:400], flush=True)
                        rows.append(dict(qtype=qname, tokens=tokens, variant=name, config=dataclasses.asdict(cfg),
                                         error=repr(exc)[:2000], ok=False, deterministic=False))
                        continue
                    again = call(xd, slots, slots, calls[0][1], calls[0][1], wd, K, *op)
                    err = ((got.double().cpu() - want.double()).norm() / want.double().norm()).item()
                    row = dict(qtype=qname, tokens=tokens, variant=name, config=dataclasses.asdict(cfg),
                               rel_err=err, ok=err < TOL, deterministic=bool(torch.equal(got, again)))
                    if not small:
                        cycle = itertools.cycle(calls)

                        def full():
                            w, r = next(cycle)
                            return moe.moe_decode(xd, w, w, r, r, wd, K, *op)

                        def gate_up():
                            w, r = next(cycle)
                            return gate_up_alone(xd, w, r, K, op)

                        ms = graph_ms(full, max(8, len(calls)))
                        ms_gu = graph_ms(gate_up, max(8, len(calls)))
                        gu_share = (fmt.nbytes[0] + fmt.nbytes[1]) / fmt.total
                        row.update(us=ms * 1e3, gate_up_us=ms_gu * 1e3, gbps=read / ms / 1e6,
                                   gate_up_gbps=read * gu_share / ms_gu / 1e6,
                                   window_ms=ms * args.window_layers)
                    rows.append(row)
                print(f"{qname} T={tokens} {name}: err {err:.1e}{'' if row['ok'] else ' FAIL'}"
                      f"{'' if row['deterministic'] else ' NONDETERMINISTIC'}"
                      + (f" {row['us']:.1f} us (gate_up {row['gate_up_us']:.1f})" if 'us' in row else ""), flush=True)
        del slots, copies
    timed = [r for r in rows if "us" in r]
    print(f"\n{'qtype':6} {'T':>2} {'us/layer':>9} {'ms/window':>9} {'GB/s':>6} {'gate_up us':>10} {'err':>8}  variant"
          f"\n(GB/s: the routed experts' quantized bytes, each expert once; ms/window: {args.window_layers} layers)")
    for r in sorted(timed, key=lambda r: (r["qtype"], r["tokens"], r["us"])):
        flag = "" if r["ok"] and r["deterministic"] else "  (REJECTED: error or nondeterministic)"
        print(f"{r['qtype']:6} {r['tokens']:>2} {r['us']:>9.1f} {r['window_ms']:>9.2f} {r['gbps']:>6.0f} "
              f"{r['gate_up_us']:>10.1f} {r['rel_err']:>8.1e}  {r['variant']}{flag}")
    good = [r for r in timed if r["qtype"] == "Q4_K" and r["ok"] and r["deterministic"]]
    best = None
    if good and args.grouped:  # the threshold follows from where the grouped design starts to win
        for tokens in sorted({r["tokens"] for r in good}):
            at = [r for r in good if r["tokens"] == tokens]
            old = next((r for r in at if r["config"]["design"] == "split" and not r["config"]["grouped"]), None)
            fast = min(at, key=lambda r: r["us"])
            versus = f", {old['us'] / fast['us']:.2f}x the split design's" if old else ""
            print(f"fastest Q4_K at T={tokens} ({tokens * K} pairs): {fast['variant']} {fast['us']:.1f} us{versus}")
    elif good:
        by = {}
        for r in good:
            by.setdefault(r["variant"], []).append(r)
        # the variant with the least total time over the token counts it ran at all of
        n = max(len(v) for v in by.values())
        best = min((v for v in by.values() if len(v) == n), key=lambda v: sum(r["us"] for r in v))[0]
        print(f"\nfastest Q4_K variant (sum over token counts): {best['variant']}\n"
              f"  LaunchConfig{tuple(best['config'].items())}")
    if skipped:
        print(f"skipped (budget {args.budget:.0f} s): {len(skipped)}: " + "; ".join(skipped))
    print(f"total {time.monotonic() - start:.0f} s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(rows=rows, skipped=skipped, best=best, shapes=dict(hidden=H, ffn=F, experts=E, topk=K)), f,
                  indent=1)


if __name__ == "__main__":
    main()
