"""The transport's cost between ranks: hidden-state bytes and milliseconds per hop.

Run as two ranks (``torchrun --nproc-per-node 2 -m strata_core.tools.bench_remote --devices
cuda:0,rank1:cpu --hidden 2048``): rank 0 sends hidden states of a decode window (``--windows``
rows, each a session's token) and of a prompt chunk (``--prompt-tokens``, 8192) to rank 1 through
the engine's own channel (strata_core/remote/group.py: header, hidden state out, status and hidden
state back), rank 1 sends them straight back; rank 0 prints bytes each way and the median and p90
milliseconds of a hop (the round trip, from rank 0's device tensor to the answer on it), and with
``--json FILE`` writes them. The layers' compute is not in it: a hop of the engine costs this plus
the remote stage's compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from strata_core.config import StrataSettings
from strata_core.remote.group import Cluster, chain_links
from strata_core.remote.launch import launch_of
from strata_core.runtime.devices import split_rank, synchronize


def _hop_ms(cluster: Cluster, hidden: torch.Tensor, links: list[str], repeats: int) -> list[float]:
    header = {"op": "echo", "shape": tuple(hidden.shape), "dtype": str(hidden.dtype).removeprefix("torch.")}
    times = []
    for _ in range(repeats):
        synchronize(hidden.device)
        start = time.perf_counter()
        out = cluster.exchange([(1, header)], hidden, links).to(hidden.device)
        synchronize(out.device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, join the ranks, measure on rank 0 (rank 1 echoes), print the table."""
    parser = argparse.ArgumentParser(prog="python -m strata_core.tools.bench_remote",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,rank1:cpu", help="rank 0's device, then rank 1's (rank1:DEVICE)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the model (2048: Qwen3-30B-A3B)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the hidden state on the wire")
    parser.add_argument("--windows", default="1,4,16,64", help="decode-window sizes (rows) to measure")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="rows of the prompt chunk to measure")
    parser.add_argument("--repeats", type=int, default=50, help="hops per size (after 5 unmeasured)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    devices = args.devices.split(",")
    settings = StrataSettings(devices=devices, nnodes=args.nnodes, node_rank=args.node_rank,
                              dist_init_addr=args.dist_init_addr, dist_timeout=60)
    launch = launch_of(settings)
    if launch is None or launch.world != 2:
        parser.error("run it as two ranks (torchrun --nproc-per-node 2, or --nnodes 2 on each host)")
    cluster = Cluster.join(settings, launch)
    device = torch.device(next(name for rank, name in map(split_rank, devices) if rank == cluster.rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cluster.rank != 0:
        cluster.serve(lambda header, hidden: hidden, device)
        cluster.close()
        return
    dtype = getattr(torch, args.dtype)
    rows = [("decode window", int(n)) for n in args.windows.split(",")] + [("prompt chunk", args.prompt_tokens)]
    results = []
    other = torch.device(split_rank(devices[1])[1])
    links = chain_links([(other, other)], device)
    print(f"{args.devices} over {links[0]}, hidden {args.hidden} {args.dtype}")
    print(f"{'step':<14} {'rows':>6} {'bytes each way':>15} {'ms/hop p50':>11} {'ms/hop p90':>11} {'GB/s':>7}")
    for kind, n in rows:
        hidden = torch.randn(n, args.hidden, device=device).to(dtype)
        _hop_ms(cluster, hidden, links, 5)
        times = sorted(_hop_ms(cluster, hidden, links, args.repeats))
        p50, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        nbytes = hidden.numel() * hidden.element_size()
        results.append({"step": kind, "rows": n, "bytes": nbytes, "ms_p50": p50, "ms_p90": p90})
        print(f"{kind:<14} {n:>6} {nbytes:>15,} {p50:>11.3f} {p90:>11.3f} {2 * nbytes / p50 / 1e6:>7.2f}")
    cluster.close()
    if args.json is not None:
        args.json.write_text(json.dumps({"devices": args.devices, "backend": links[0], "hidden": args.hidden,
                                         "dtype": args.dtype, "hops": results}, indent=1))


if __name__ == "__main__":
    main()
