"""What a prompt's timeline says (a Chrome trace of ``tools/profile_decode.py --trace``): per device and
stream, the busy time of kernels and copies; the host's top-level operations (what the host spends a
prompt on, and whether it waits for a device); and, with ``--layer N``, one layer's GPU events in order.

    python tools/trace_summary.py prompt.json [--top 20] [--layer 20] [--marker sdpa]

How to read it: a prompt whose host never waits (no time in the routing read's sync) is host-bound;
one whose copy stream idles between layers leaves the link unused.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list[dict]:
    """The complete events (``ph == "X"``) of a Chrome trace file."""
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def stream_busy(events: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (device, stream): ms of each GPU category (kernels, copies, memsets)."""
    busy: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            key = (str(e["args"].get("device")), str(e["args"].get("stream")))
            busy[key][e["cat"]] += e["dur"] / 1e3
    return {key: dict(cats) for key, cats in busy.items()}


def host_ops(events: list[dict]) -> dict[str, tuple[int, float]]:
    """Per name, (calls, ms) of the top-level CPU operations: those inside no other on the same thread."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"]))
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    ends: dict[int, float] = {}
    for e in ops:
        if e["ts"] < ends.get(e["tid"], float("-inf")):
            continue  # nested in the last top-level op of its thread
        ends[e["tid"]] = e["ts"] + e["dur"]
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"] / 1e3
    return {name: (int(n), ms) for name, (n, ms) in totals.items()}


def layer_events(events: list[dict], layer: int, marker: str = "sdpa") -> list[dict]:
    """The GPU events from the ``layer``-th kernel whose name holds ``marker`` (one a layer: the
    attention) to the next one, in start order."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in gpu if marker in e["name"]]
    if layer + 1 >= len(starts):
        raise SystemExit(f"the trace has {len(starts)} kernels named like {marker!r}: no layer {layer} to show")
    return [e for e in gpu if starts[layer] <= e["ts"] < starts[layer + 1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=20, help="host operations to list")
    parser.add_argument("--layer", type=int, help="also list this layer's GPU events")
    parser.add_argument("--marker", default="sdpa", help="a kernel name part that occurs once a layer")
    args = parser.parse_args()
    events = load_events(args.trace)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1e3
    print(f"GPU span {span:.1f} ms")
    for (device, stream), cats in sorted(stream_busy(events).items()):
        print(f"  device {device} stream {stream}: " + ", ".join(f"{cat} {ms:.1f} ms" for cat, ms in cats.items()))
    ops = host_ops(events)
    print(f"host, top-level operations: {sum(ms for _, ms in ops.values()):.1f} ms")
    for name, (n, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {ms:8.1f} ms {n:6d}x  {name[:90]}")
    if args.layer is not None:
        chosen = layer_events(events, args.layer, args.marker)
        print(f"layer {args.layer}: {(chosen[-1]['ts'] - chosen[0]['ts']) / 1e3:.2f} ms from its first event")
        for e in chosen:
            print(f"  {(e['ts'] - chosen[0]['ts']) / 1e3:8.3f} {e['dur'] / 1e3:7.3f} ms  device {e['args'].get('device')} "
                  f"stream {e['args'].get('stream')}  {e['name'][:70]}")


if __name__ == "__main__":
    main()
