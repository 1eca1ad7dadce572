"""Time the CPU share of a decode MoE layer: ``cpu_experts_ffn`` of 8 experts x 1 token, Qwen3-30B-A3B
shapes (hidden 2048, expert FFN 768), as the GPU hybrid (``--pcie-frac 0``) runs it.

    python tools/cpu_share_bench.py [--qtype Q4_K] [--threads 1,2] [--repeats 50] [--json out.json]

First what decides the kernels' threading and speed on this host: the CPUs this process may use and
their cores, a cgroup quota, ``OMP_*`` variables, the OpenMP runtimes mapped into the process (two
would give the kernels' parallel regions a thread count of their own, whatever torch.set_num_threads
said), the instruction set, the CPU a team burns after a region (its spin-wait), and one matrix on one
thread in cache (the kernel's own speed, no DRAM).
Then each case is (x dtype, torch threads, where): ``main`` calls on this thread; ``worker`` calls on a
one-thread ThreadPoolExecutor whose initializer calls ``torch.set_num_threads(N)``, as
``backend._cpu_pool`` builds it. The weights cycle over ``--experts`` experts so they come from DRAM,
not the cache. Prints the median milliseconds of a call, the expert GB/s (quantized bytes read), and
the OpenMP threads the kernel's parallel region actually ran (``strata::cpu_kernel_threads``).
With CUDA the weights are pinned and a ``hybrid`` row times the whole per-layer path of
``MissShare.submit``: the hidden state's copy to the host, the worker's call, the rows'
copy back (what a decode layer waits for).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as T

from strata_core.ops.cpu_kernels import ISA_NAMES, cpu_kernels, qlinear_grouped  # strata_core.ops first: experts.cpu_ffn imports through it
from strata_core.ops.qdecode import block_geometry
from strata_core.experts.cpu_ffn import cpu_experts_ffn
from strata_core.experts.ffn import SILU
from strata_core.quant import random_blocks

H, FF, K = 2048, 768, 8


def layer_parts(qtype: T, n: int, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(gate, up, down) raw blocks of ``n`` random experts, views of one ``[n, packed]`` buffer as the arena holds them."""
    rng = np.random.default_rng(0)
    shapes = ((FF, H), (FF, H), (H, FF))
    bs = block_geometry(qtype)[0]
    blocks = [random_blocks(qtype, n * r * c // bs, rng, 0.05).reshape(n, -1) for r, c in shapes]
    packed = torch.from_numpy(np.concatenate(blocks, axis=1))
    if pin:
        packed = packed.pin_memory()
    sizes = [b.shape[1] for b in blocks]
    return [tuple(packed[e].split(sizes)) for e in range(n)]


def host_report() -> dict[str, object]:
    """What decides the CPU share's threading on this host (module doc)."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota = f.read().strip()
    except OSError:
        quota = "n/a"
    with open("/proc/self/maps") as f:
        runtimes = sorted({line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]})
    return {"torch": torch.__version__, "cpus": len(cpus), "cores": len(cores), "cgroup_cpu_max": quota,
            "torch_threads": torch.get_num_threads(), "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
            "openmp_runtimes": runtimes, "isa": ISA_NAMES[torch.ops.strata.cpu_kernel_isa()]}


def spin_after_region(threads: int, gap: float = 0.005, n: int = 40) -> float:
    """Seconds of CPU the process burns per parallel region of ``threads`` threads on this thread while it
    then sleeps ``gap``: the OpenMP team's wait before its threads sleep (libgomp spins, unless
    ``OMP_WAIT_POLICY=passive``)."""
    torch.set_num_threads(threads)
    torch.ops.strata.cpu_kernel_threads()

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    start = cpu()
    for _ in range(n):
        torch.ops.strata.cpu_kernel_threads()
        time.sleep(gap)
    return (cpu() - start) / n


def timed(fn: Callable[[int], object], repeats: int) -> float:
    """Median seconds of ``fn(i)`` over ``repeats`` calls after two unmeasured ones."""
    fn(0), fn(1)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtype", default="Q4_K")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not cpu_kernels():
        raise SystemExit("the CPU kernels are not loaded")
    qtype = T[args.qtype]
    cuda = torch.cuda.is_available()
    parts = layer_parts(qtype, args.experts, pin=cuda)
    qtypes, shapes = (qtype,) * 3, ((FF, H), (FF, H), (H, FF))
    layer_bytes = K * sum(p.numel() for p in parts[0])
    groups = args.experts // K

    def call(x: torch.Tensor, i: int) -> torch.Tensor:
        g = i % groups
        return cpu_experts_ffn(x, parts[g * K:(g + 1) * K], [1] * K, qtypes, shapes, SILU, list(range(K)))

    rows = []

    def report(case: str, seconds: float, threads_seen: int) -> None:
        gbps = layer_bytes / seconds / 1e9
        rows.append({"case": case, "ms": seconds * 1e3, "gbps": gbps, "omp_threads": threads_seen})
        print(f"{case:40s} {seconds * 1e3:8.3f} ms  {gbps:6.2f} GB/s  kernel threads {threads_seen}", flush=True)

    report_host = host_report()
    for key, value in report_host.items():
        print(f"{key}: {value}")
    threads_max = max(int(t) for t in args.threads.split(","))
    print(f"CPU burnt after one {threads_max}-thread parallel region, then 5 ms asleep: "
          f"{spin_after_region(threads_max) * 1e3:.2f} ms", flush=True)
    torch.set_num_threads(1)
    gate = parts[0][0]
    x1 = torch.randn(1, H)
    one = timed(lambda i: qlinear_grouped(x1, [gate], [1], qtype, FF), args.repeats * 4)
    print(f"one {FF}x{H} matrix in cache, 1 thread: {one * 1e6:.0f} us, {gate.numel() / one / 1e9:.2f} GB/s", flush=True)
    print(f"{args.qtype}: {K} experts x 1 token, {layer_bytes / 1e6:.1f} MB a call, weights "
          f"{'pinned' if cuda else 'plain'}, {args.experts} experts cycled", flush=True)
    device = torch.device("cuda" if cuda else "cpu")
    small = torch.randn(64, device=device)

    def step() -> float:
        """Seconds of what the main thread does between two CPU shares: small device ops, a host read."""
        t0 = time.perf_counter()
        y = small
        for _ in range(32):
            y = y * 1.0001
        y.sum().item()
        return time.perf_counter() - t0

    for threads in [int(t) for t in args.threads.split(",")]:
        pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
        torch.set_num_threads(threads)
        seen = pool.submit(torch.ops.strata.cpu_kernel_threads).result()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(K, H).to(dtype)
            name = f"{str(dtype).removeprefix('torch.')} {threads}t"
            time.sleep(0.05)  # this thread's OpenMP team asleep, as in a GPU decode
            report(f"{name} worker", timed(lambda i: pool.submit(call, x, i).result(), args.repeats), seen)

            def after_main_region(i: int) -> None:  # this thread's team still spinning (libgomp's wait)
                torch.ops.strata.cpu_kernel_threads()
                pool.submit(call, x, i).result()

            report(f"{name} worker, main team spinning", timed(after_main_region, args.repeats), seen)
            report(f"{name} main", timed(lambda i: call(x, i), args.repeats), torch.ops.strata.cpu_kernel_threads())
            if cuda:
                hidden = torch.randn(1, H, device="cuda").to(dtype)
                pairs = torch.arange(K, device="cuda")

                def hybrid(i: int) -> None:
                    xs = hidden[pairs // K].cpu()  # [K, H]: the host read of the layer
                    pool.submit(call, xs, i).result().to("cuda", dtype)
                    torch.cuda.synchronize()

                report(f"{name} hybrid (copy, worker, back)", timed(hybrid, args.repeats), seen)
        idle, busy = [], []
        for i in range(args.repeats):
            time.sleep(0.05)
            idle.append(step())
            pool.submit(call, x, i).result()
            busy.append(step())  # the worker's team spinning
        print(f"main-thread step {threads}t: {statistics.median(idle) * 1e6:.0f} us with the worker's team asleep, "
              f"{statistics.median(busy) * 1e6:.0f} us right after a worker call", flush=True)
        rows.append({"case": f"main step {threads}t", "idle_us": statistics.median(idle) * 1e6,
                     "after_worker_us": statistics.median(busy) * 1e6})
        pool.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": report_host, "one_matrix_gbps": gate.numel() / one / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
