"""Where a CPU decode token's time goes: `strata bench`'s decode windows under the torch profiler.

    python tools/profile_cpu_decode.py MODEL.gguf [--context 1k] [--tokens 16] [--top 18]

Runs ``strata bench --devices cpu --prompts 16 --repeats 1`` with the profiler on only around the timed
decode windows (the prompt fills and the prefill row are not profiled), then prints the ops with the
most self CPU time. Divide by ``--tokens`` for a token's share; with the CPU kernels ``strata::linear_cpu``
holds the dense weight products, ``strata::attention_cpu`` the attention, ``strata::qlinear_slots`` (or
``strata::qlinear_grouped``) the routed experts; without them ``aten::mm`` and ``aten::bmm``.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch.profiler import ProfilerActivity, profile

from strata_core.cli import main as strata_main
from strata_core.tools import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", default="1k")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    timed = bench._timed

    def profiled(engine: Any, work: Any) -> tuple[float, dict[str, Any]]:
        if getattr(work, "__name__", "") != "windows":  # bench_decode's timed closure
            return timed(engine, work)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = timed(engine, work)
        print(f"decode: {result[0] * 1e3 / args.tokens:.1f} ms a token (profiled)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))
        return result

    bench._timed = profiled
    raise SystemExit(strata_main(["bench", "--model", args.model, "--devices", "cpu", "--prompts", "16", "--contexts", args.context,
                 "--decode-tokens", str(args.tokens), "--repeats", "1"]))


if __name__ == "__main__":
    main()
