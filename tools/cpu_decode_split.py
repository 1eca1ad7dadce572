"""Where a CPU decode window's wall time goes, by Python function: `strata bench`'s decode windows with
the forward's functions and the CPU ops wrapped in wall-clock timers.

    OMP_NUM_THREADS=2 python tools/cpu_decode_split.py MODEL.gguf [--context 1k] [--tokens 64] [--sessions 1]

Runs ``strata bench --devices cpu --prompts 16 --repeats 1`` and prints, for each wrapped function, its
calls, inclusive and exclusive milliseconds a window of the timed decode windows (``--sessions`` rows
each; ``op.*``: the ``torch.ops.strata`` kernels themselves; ``exclusive``: less the wrapped functions it
called). Unlike the torch profiler (tools/profile_cpu_decode.py) it counts the Python around the ops too;
each wrapper adds about a microsecond to its caller, so compare trees under this tool, not against
``strata bench``.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch

import strata_core.engine as engine_mod
import strata_core.experts.cpu_ffn as cpu_ffn
import strata_core.experts.device_rows as device_rows
import strata_core.model.kvcache as kvcache
import strata_core.model.ops as model_ops
import strata_core.model.transformer as transformer
import strata_core.ops.combine as combine
import strata_core.ops.cpu_kernels as cpu_kernels
import strata_core.ops.matmul as matmul
import strata_core.runtime.runner as runner
from strata_core.cli import main as strata_main
from strata_core.tools import bench

OPS = ("attention_cpu", "linear_cpu", "norm_rope_cpu", "route_cpu", "rms_norm_cpu", "combine_cpu", "slot_ffn_cpu",
       "add_rms_norm_cpu", "qkv_rope_cpu", "route_slot_ffn_cpu")
WRAPPERS = OPS + ("cpu_slot_ffn", "rms_norm", "linear", "combine_rows", "held_slots", "routed_experts")  # a tree's


class Split:
    """Inclusive and exclusive seconds and calls per label, of the wrapped functions."""

    def __init__(self) -> None:
        self.incl: dict[str, float] = collections.defaultdict(float)
        self.excl: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._stack: list[float] = []  # per open call, the seconds of its wrapped callees

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                inner = self._stack.pop()
                self.incl[label] += seconds
                self.excl[label] += seconds - inner
                self.calls[label] += 1
                if self._stack:
                    self._stack[-1] += seconds

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.incl.clear(), self.excl.clear(), self.calls.clear()

    def table(self, tokens: int) -> str:
        lines = [f"{'function':28s} {'calls/window':>12s} {'incl ms':>8s} {'excl ms':>8s}"]
        for label in sorted(self.incl, key=lambda k: -self.excl[k]):
            lines.append(f"{label:28s} {self.calls[label] / tokens:12.1f} {self.incl[label] * 1e3 / tokens:8.3f} "
                         f"{self.excl[label] * 1e3 / tokens:8.3f}")
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", default="1k")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=1, help="sessions a decode window")
    args = parser.parse_args()
    split = Split()
    split.wrap(engine_mod.Engine, "decode_window", "engine.decode_window")
    for name in ("decode_window", "decode_layers", "embed", "head"):
        split.wrap(runner.Runner, name, f"runner.{name}")
    for name in ("attention", "attention_spans", "_cpu_qkv", "_cpu_qkv_write", "attend", "moe", "route", "head",
                 "embed", "cpu_layer", "attention_out", "moe_out"):
        if hasattr(transformer.MoEModel, name):  # a method of this tree
            split.wrap(transformer.MoEModel, name, f"model.{name}")
    for name in ("write", "paged", "write_pools"):
        if hasattr(kvcache.KVCache, name):
            split.wrap(kvcache.KVCache, name, f"kv.{name}")
    for name in ("__call__", "rows", "_slot_rows", "_takes_slots", "routed_cpu"):
        if hasattr(device_rows.CachedExpertRows, name):
            split.wrap(device_rows.CachedExpertRows, name, f"rows.{name}")
    for module in (transformer, model_ops, matmul, combine, device_rows, cpu_kernels, cpu_ffn):
        for name in WRAPPERS:
            if callable(getattr(module, name, None)):
                split.wrap(module, name, name)
    timed, wrapped_ops = bench._timed, []

    def profiled(engine: Any, work: Any) -> tuple[float, dict[str, Any]]:
        if getattr(work, "__name__", "") != "windows":  # bench_decode's timed closure
            return timed(engine, work)
        if not wrapped_ops:  # the ops exist once the kernels are loaded
            for name in OPS:
                if hasattr(torch.ops.strata, name):  # an op of this tree
                    split.wrap(torch.ops.strata, name, f"op.{name}")
            wrapped_ops.append(True)
        split.clear()
        result = timed(engine, work)
        print(f"decode: {result[0] * 1e3 / args.tokens:.3f} ms a window of {args.sessions} (wrapped)")
        print(split.table(args.tokens))
        return result

    bench._timed = profiled
    raise SystemExit(strata_main(["bench", "--model", args.model, "--devices", "cpu", "--prompts", "16",
                                  "--contexts", args.context, "--decode-tokens", str(args.tokens), "--repeats", "1",
                                  "--sessions", str(args.sessions)]))


if __name__ == "__main__":
    main()
