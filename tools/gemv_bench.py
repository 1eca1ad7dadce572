"""Time ``strata::q8_linear``'s Triton kernel against cuBLAS's bf16 ``x @ W.T`` at the dense decode
shapes of Qwen3-30B-A3B, the products a decode step reads every dense weight for.

    python tools/gemv_bench.py [--tokens 1,2,4,8,16,32] [--budget 35] [--json PATH] [--no-graphs]
                               [--gemv-variants] [--small]

Shapes ``[N, K]``: the fused QKV product ``[5120, 2048]``, the attention output ``[2048, 4096]``, the
router ``[128, 2048]`` and the output head ``[151936, 2048]``, each at M = ``--tokens`` rows of bf16 x.
The calls rotate over copies of the weights whose total exceeds four times the H200's 60 MB L2, so no
call finds its weights in the L2. Timing, as a decode window runs them: one call per copy (at least
16) captured in a CUDA graph, the median of 7 replays divided by the calls (no host launch cost, which
from Python is as long as these kernels); ``--no-graphs``: ``triton.testing.do_bench``'s median of
single calls, host launch cost included. Rows: cuBLAS bf16 on the bf16 dequantized matrix; the gemv
kernel (``q8_0``: :data:`strata_core.ops.dense_q8.DEFAULT_LAUNCH`, up to 8 rows; ``--gemv-variants``:
also the other launches of ``_variants()`` up to 4 rows; ``bn=1`` is llama.cpp MMVQ's one row a
block); the rows kernel (``q8_rows``, ``q8_rows_triton``: each launch of ``_rows_variants()``, the
default :data:`~strata_core.ops.dense_q8.DEFAULT_ROWS` first and alone at one row), with whether its
last row is the bits of that row alone (``NOT-INVARIANT`` if not). Each kernel output is checked
against the float32 product on the dequantized matrix (bf16 tolerance of tests/test_dense_q8.py: 1e-2
of the largest output; 2e-2 for the rows kernel's int8 mode). Printed as a table (us, GB/s of weight
bytes read: Q8_0 34 bytes per 32 values, bf16 2 a value) and written to ``$OUT/gemv_bench.json`` (or
``--json``). Variants other than the defaults not reached within ``--budget`` seconds are listed as
skipped. Needs CUDA and Triton (``--help`` works anywhere); ``--small`` runs tiny shapes on the CPU
under the Triton interpreter (``TRITON_INTERPRET=1`` and a CPU triton on the path), a check of the
tool, not a measurement.

Make the winners the defaults: their fields as the defaults of ``Q8Config`` / ``Q8RowsConfig`` in
strata_core/ops/dense_q8.py, and the row counts each serves (``GEMV_MAX_ROWS`` there, ``Q8_MAX_ROWS``
in strata_core/model/weights.py) from where they beat cuBLAS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

#: The dense decode products of Qwen3-30B-A3B: name -> (N, K).
SHAPES = {"qkv": (5120, 2048), "attn_output": (2048, 4096), "router": (128, 2048), "head": (151936, 2048)}
#: ``--small``: shapes for the interpreter.
SMALL_SHAPES = {"qkv": (80, 64), "router": (8, 96)}
#: Bytes of weights the copies of one shape add up to at least (four times the H200's L2).
ROTATE_BYTES = 4 * 60 * 10**6


def _variants():
    from strata_core.ops.dense_q8 import DEFAULT_LAUNCH, Q8Config

    return [DEFAULT_LAUNCH, Q8Config(bn=1), Q8Config(tile=4096), Q8Config(tile=16384, warps=8), Q8Config(programs=512),
            Q8Config(programs=4096), Q8Config(tile=4096, warps=2), Q8Config(max_mb=1), Q8Config(max_bn=4)]


def _rows_variants():
    """Launches of the rows kernel (``q8_rows_triton``), the default first."""
    from strata_core.ops.dense_q8 import DEFAULT_ROWS, Q8RowsConfig as R

    return [DEFAULT_ROWS, R(bn=128), R(bn=32), R(nb=8), R(nb=2), R(programs=512), R(programs=0), R(mode="deq"),
            R(mode="deq", bn=128), R(mode="i8"), R(mode="i8", bn=128), R(bm=32), R(stages=2), R(warps=8),
            R(bn=32, programs=1024), R(bn=16, nb=8, programs=1024)]


def _copies(t, nbytes: int, clone, total: int) -> list:
    """``t`` and ``clone(t)``s, enough that their bytes reach ``total``."""
    return [t] + [clone(t) for _ in range(max(1, math.ceil(total / nbytes)) - 1)]


def _rotating(fn, operands: list):
    """A no-argument callable calling ``fn(*operands[i])`` with the next i each call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(operands)
        return fn(*operands[state["i"]])
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4", help="rows of x (decode sessions), comma-separated")
    parser.add_argument("--budget", type=float, default=35.0,
                        help="seconds; variants other than the default past it are skipped")
    parser.add_argument("--no-graphs", dest="graphs", action="store_false",
                        help="time with triton's do_bench (host launch cost included) instead of CUDA graph replays")
    parser.add_argument("--gemv-variants", action="store_true",
                        help="also the gemv kernel's other launches (at most 4 rows)")
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--json", help="output path (default: $OUT/gemv_bench.json, else ./gemv_bench.json)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType as T

    from strata_core.ops import dense_q8
    from strata_core.quant import random_blocks

    if args.small and not (os.environ.get("TRITON_INTERPRET") == "1" and dense_q8.HAS_TRITON):
        raise SystemExit("gemv_bench --small needs TRITON_INTERPRET=1 and Triton")
    if not args.small and not (torch.cuda.is_available() and dense_q8.HAS_TRITON):
        raise SystemExit("gemv_bench needs a CUDA device and Triton")
    import triton

    start = time.perf_counter()
    dev = torch.device("cpu" if args.small else "cuda:0")
    shapes = SMALL_SHAPES if args.small else SHAPES
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = _variants() if args.gemv_variants else _variants()[:1]
    rows, skipped = [], []

    def bench(fn, operands: list) -> float:
        """us a call of ``fn(*operands[i])``, the calls rotating over ``operands``."""
        if args.small:  # one call's wall time: a check that the timed callable runs
            t0 = time.perf_counter()
            fn(*operands[0])
            return (time.perf_counter() - t0) * 1e6
        if not args.graphs:
            return triton.testing.do_bench(_rotating(fn, operands), warmup=10, rep=60, return_mode="median") * 1e3
        # as a decode window runs them: captured in a CUDA graph (no host launch cost), one call per copy
        calls = max(len(operands), 16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for ops in operands[:2]:
                fn(*ops)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*operands[i % len(operands)])
        graph.replay()
        times = []
        for _ in range(7):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3 / calls)
        del graph
        return sorted(times)[len(times) // 2]

    cases = []  # one per (shape, M): the operands, their copies and the float32 product on exact values
    for name, (N, K) in shapes.items():
        raw = torch.from_numpy(random_blocks(T.Q8_0, N * K // 32, np.random.default_rng(N), scale=0.05))
        q8 = dense_q8.repack_q8_0(raw.reshape(-1).to(dev), (N, K))
        exact = q8.dequantize()  # [N, K] float32
        bf16 = exact.to(torch.bfloat16)
        total = 2 * bf16.nbytes if args.small else ROTATE_BYTES
        q8s = _copies(q8, q8.nbytes, lambda m: dense_q8.Q8Matrix(m.codes.clone(), m.scales.clone()), total)
        bf16s = _copies(bf16, bf16.nbytes, torch.clone, total)
        for M in tokens:
            x = torch.randn(M, K, device=dev, generator=torch.Generator(dev).manual_seed(M)).to(torch.bfloat16)
            cases.append(dict(name=name, N=N, K=K, M=M, x=x, want=x.float() @ exact.T, q8s=q8s, bf16s=bf16s))
        del exact

    for case in cases:  # cuBLAS first, then each variant over every case (the default always runs)
        x = case["x"]
        us = bench(lambda w: x @ w.T, [(w,) for w in case["bf16s"]])
        rows.append(dict(shape=case["name"], N=case["N"], K=case["K"], M=case["M"], kernel="cublas-bf16",
                         config=None, us=us, gbps=case["bf16s"][0].nbytes / us / 1e3, copies=len(case["bf16s"]),
                         rel_err=None))
    rows_variants = _rows_variants()
    for config in rows_variants:  # the rows kernel: each variant over every case of 2+ rows (1 row: default only)
        for case in cases:
            if config is not rows_variants[0] and (time.perf_counter() - start > args.budget or case["M"] == 1):
                if case["M"] > 1:
                    skipped.append(dict(shape=case["name"], M=case["M"], config=dataclasses.asdict(config)))
                continue
            x, q8s, want = case["x"], case["q8s"], case["want"]
            try:
                got = dense_q8.q8_rows_triton(x, q8s[0].codes, q8s[0].scales, config)
                one = dense_q8.q8_rows_triton(x[-1:], q8s[0].codes, q8s[0].scales, config)
            except Exception as e:  # a launch that does not compile on this device: listed, not fatal
                print(f"rows {config} failed: {type(e).__name__}: {str(e)[:300]}")
                break
            err = float((got.float() - want).abs().max() / want.abs().max())
            tol = 2e-2 if config.mode == "i8" else 1e-2
            us = bench(lambda c, s: dense_q8.q8_rows_triton(x, c, s, config), [(m.codes, m.scales) for m in q8s])
            rows.append(dict(shape=case["name"], N=case["N"], K=case["K"], M=case["M"], kernel="q8_rows",
                             config=dataclasses.asdict(config), launch=config.launch(case["N"], case["K"]),
                             us=us, gbps=q8s[0].nbytes / us / 1e3, copies=len(q8s), rel_err=err, ok=err <= tol,
                             invariant=bool(torch.equal(one[0], got[-1]))))
    for config in variants:
        for case in cases:
            if case["M"] > 8 or (config is not variants[0] and (time.perf_counter() - start > args.budget
                                                                 or case["M"] > 4)):
                skipped.append(dict(shape=case["name"], M=case["M"], config=dataclasses.asdict(config)))
                continue
            x, q8s, want = case["x"], case["q8s"], case["want"]
            got = dense_q8.q8_linear_triton(x, q8s[0].codes, q8s[0].scales, config)
            err = float((got.float() - want).abs().max() / want.abs().max())
            us = bench(lambda c, s: dense_q8.q8_linear_triton(x, c, s, config), [(m.codes, m.scales) for m in q8s])
            rows.append(dict(shape=case["name"], N=case["N"], K=case["K"], M=case["M"], kernel="q8_0",
                             config=dataclasses.asdict(config), launch=config.launch(case["M"], case["N"], case["K"]),
                             us=us, gbps=q8s[0].nbytes / us / 1e3, copies=len(q8s), rel_err=err, ok=err <= 1e-2))
    rows.sort(key=lambda r: (list(shapes).index(r["shape"]), r["M"]))

    defaults = dataclasses.asdict(dense_q8.Q8Config())
    rows_defaults = dataclasses.asdict(dense_q8.Q8RowsConfig())
    print(f"{'shape':12} {'M':>2} {'kernel':12} {'launch':18} {'config (vs defaults)':28} {'us':>8} "
          f"{'GB/s':>7} {'err':>8}")
    for r in rows:
        base = rows_defaults if r["kernel"] == "q8_rows" else defaults
        cfg = "" if r["config"] is None else (
            ",".join(f"{k}={v}" for k, v in r["config"].items() if base[k] != v) or "defaults")
        if r.get("invariant") is False:
            cfg += " NOT-INVARIANT"
        launch = "" if r["config"] is None else str(tuple(r["launch"]))
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}" + ("" if r["ok"] else " BAD")
        print(f"{r['shape']:12} {r['M']:>2} {r['kernel']:12} {launch:18} {cfg:28} {r['us']:8.2f} {r['gbps']:7.0f} "
              f"{err:>8}")
    for shape in shapes:
        for M in tokens:
            mine = [r for r in rows if r["shape"] == shape and r["M"] == M]
            base = next(r["us"] for r in mine if r["kernel"] == "cublas-bf16")
            for kernel in ("q8_0", "q8_rows"):
                best = min((r for r in mine if r["kernel"] == kernel and r["ok"]), key=lambda r: r["us"], default=None)
                if best is not None:
                    print(f"best {kernel} {shape} M={M}: {best['us']:.2f} us ({best['gbps']:.0f} GB/s) vs cuBLAS bf16 "
                          f"{base:.2f} us: x{base / best['us']:.2f}  config {best['config']}")
    if skipped:
        print(f"skipped (past --budget {args.budget:g} s): {len(skipped)} runs")
    out = Path(args.json or Path(os.environ.get("OUT", ".")) / "gemv_bench.json")
    device = "cpu (interpreter)" if args.small else torch.cuda.get_device_name(dev)
    out.write_text(json.dumps(dict(device=device, rows=rows, skipped=skipped,
                                   seconds=time.perf_counter() - start), indent=1))
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
