"""NUMA placement of the experts the CPU computes from: on a host with several memory nodes (a two-socket
server, a chip split into NUMA domains), their pages are interleaved over the nodes this process may run on.

The CPU kernels' threads (every core torch is given, placed by the OS) then read every node's memory
controllers at once, where first-touch placement would put a buffer's pages wherever its filling threads
happened to run, and a layer's experts on one node would be read at that node's bandwidth by the threads of
every node. It is llama.cpp's ``--numa distribute`` for the buffers the CPU reads: a CPU device's expert
slots, and the arena where it is ordinary RAM (no accelerator to page-lock it). A page-locked arena
(experts/host_region.py) keeps first-touch placement: the GPU's copies read it too, and from one socket half
its pages would then cross to the other (not measured).

``host_nodes`` reads the topology from sysfs; ``interleave`` applies the policy (Linux ``mbind`` with
``MPOL_INTERLEAVE``) to a buffer before its pages are first written. Placement never changes a value: it
only decides which node's memory holds a page. On a host of one node, or where the kernel refuses the call
(a container's seccomp profile, no NUMA support), nothing is done and the log says why, once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import torch

__all__ = ["MPOL_INTERLEAVE", "host_nodes", "interleave", "parse_cpulist", "placement_nodes"]

log = logging.getLogger(__name__)

#: the Linux memory policy that spreads a range's pages over a set of nodes, page by page
MPOL_INTERLEAVE = 3
#: ``mbind``'s system call number by machine (glibc exports no wrapper; libnuma is not a dependency)
SYS_MBIND = {"x86_64": 237, "aarch64": 235}
SYSFS_NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist (``"0-3,8,10-11"``); empty for an empty list."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def host_nodes(root: Path = SYSFS_NODES, allowed: set[int] | None = None) -> list[int]:
    """The memory nodes with CPUs this process may run on (``allowed``, default its affinity), in order;
    ``[]`` where the host has no NUMA topology in ``root`` (not Linux, or sysfs not mounted)."""
    if not root.is_dir():
        return []
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((path / "cpulist").read_text())
        except OSError:
            continue
        if cpus & allowed:
            nodes.append(int(path.name[4:]))
    return nodes


@functools.cache
def placement_nodes() -> tuple[int, ...]:
    """This process's nodes (``host_nodes``), found once; logged where there are several."""
    nodes = tuple(host_nodes())
    if len(nodes) > 1:
        log.info("numa: %d memory nodes (%s) hold this process's CPUs: the memory the CPU computes experts from "
                 "is interleaved over them", len(nodes), ", ".join(map(str, nodes)))
    return nodes


def interleave(buffer: torch.Tensor, nodes: tuple[int, ...] | list[int], what: str) -> bool:
    """Interleave the whole pages of ``buffer`` (a contiguous CPU tensor whose pages are not written yet)
    over ``nodes``; returns whether the policy was applied. Fewer than two nodes: nothing to do. ``what``
    names the buffer in the log."""
    if len(set(nodes)) < 2 or buffer.device.type != "cpu" or buffer.numel() == 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = buffer.data_ptr()
    first = (start + page - 1) // page * page
    last = (start + buffer.numel() * buffer.element_size()) // page * page
    if last <= first:
        return False
    mask = sum(1 << node for node in set(nodes))
    words = max(nodes) // 64 + 1
    nodemask = (ctypes.c_ulong * words)(*[(mask >> (64 * i)) & (2 ** 64 - 1) for i in range(words)])
    error = _mbind(first, last - first, MPOL_INTERLEAVE, nodemask, 64 * words)
    if error:
        _refused(error)
        return False
    log.debug("numa: %s: %.2f GiB interleaved over nodes %s", what, (last - first) / (1 << 30), nodes)
    return True


def _mbind(start: int, length: int, mode: int, nodemask: ctypes.Array, maxnode: int) -> int:
    """``mbind(start, length, mode, nodemask, maxnode + 1, 0)``: 0, or the errno it failed with (``ENOSYS``
    where this machine has no known call number)."""
    number = SYS_MBIND.get(platform.machine())
    if number is None:
        return 38  # ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_int(mode),
                          nodemask, ctypes.c_ulong(maxnode + 1), ctypes.c_uint(0))
    return ctypes.get_errno() if result != 0 else 0


@functools.cache
def _refused(error: int) -> None:
    """Say once that the kernel refused the placement (first-touch placement stays)."""
    log.info("numa: the kernel refused to interleave the CPU experts' memory (%s): pages stay where they are "
             "first written", os.strerror(error))
