"""Where one thread of a running ``strata serve`` spends its time, from a py-spy recording.

    py-spy record --pid PID --duration 12 --rate 200 --format raw --idle --threads --nonblocking -o spy.txt
    python tools/pyspy_summary.py spy.txt [--thread strata-compute] [--top 30]

On the device machine py-spy comes as a carried wheel (``py-spy`` in ``.whl``, the device README's notes);
``--nonblocking`` samples without pausing the server. ``--format raw`` writes one line per distinct stack, ``thread (tid): name;frame;frame;... count``; with
``--threads`` the first frame names the thread. This prints, for the samples of the thread whose name
contains ``--thread`` (the scheduler's worker by default), each function's inclusive share (its
samples anywhere in the stack, counted once per stack) and the lines the samples stood on (where the
host waited: a ``synchronize``, a blocking queue get, a launch into a full queue). With ``--idle`` the
waits are counted, which is what shows a host-bound or device-bound worker apart.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable
from pathlib import Path


def thread_stacks(lines: Iterable[str], thread: str) -> list[tuple[list[str], int]]:
    """The ``(frames, samples)`` of every stack of the thread whose name contains ``thread`` (the thread's
    own frame dropped)."""
    stacks = []
    for line in lines:
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if thread in frames[0]:
            stacks.append((frames[1:], int(count)))
    return stacks


def function_name(frame: str) -> str:
    """``Class.method (path/to/file.py:123)`` -> ``Class.method (file.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


def shares(stacks: list[tuple[list[str], int]]) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, inclusive samples per function, samples per innermost frame with its line)."""
    total, inclusive, leaves = 0, Counter(), Counter()
    for frames, n in stacks:
        total += n
        for name in {function_name(f) for f in frames}:
            inclusive[name] += n
        if frames:
            name, _, where = frames[-1].partition(" (")
            leaves[f"{name} ({where.rsplit('/', 1)[-1]}"] += n
    return total, inclusive, leaves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--thread", default="strata-compute", help="part of the thread's name")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    total, inclusive, leaves = shares(thread_stacks(args.raw.read_text().splitlines(), args.thread))
    if not total:
        raise SystemExit(f"{args.raw}: no samples of a thread named like {args.thread!r}")
    print(f"{total} samples of {args.thread}\n\n| function | samples | share |\n|---|---:|---:|")
    for name, n in inclusive.most_common(args.top):
        print(f"| {name} | {n} | {100 * n / total:.1f}% |")
    print("\n| where the samples stood | samples | share |\n|---|---:|---:|")
    for name, n in leaves.most_common(args.top):
        print(f"| {name} | {n} | {100 * n / total:.1f}% |")


if __name__ == "__main__":
    main()
