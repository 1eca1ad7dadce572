"""NUMA placement (runtime/numa.py): the topology read from sysfs, the pages ``interleave`` hands to ``mbind``,
the buffers the engine interleaves, and the system call itself on this host."""

from __future__ import annotations

import logging
import os
import platform

import pytest
import torch

from strata_core.engine import Engine
from strata_core.experts import arena as arena_module
from strata_core.experts import cache as cache_module
from strata_core.runtime import numa


def test_cpulists_are_parsed_into_cpus():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("5") == {5}
    assert numa.parse_cpulist("\n") == set()


def test_the_nodes_are_those_with_cpus_this_process_may_use(tmp_path):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", ""), ("node10", "8-9")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node3").mkdir()  # no cpulist: skipped
    assert numa.host_nodes(tmp_path, allowed=set(range(10))) == [0, 1, 10]  # node2 has memory only
    assert numa.host_nodes(tmp_path, allowed={5, 6}) == [1]
    assert numa.host_nodes(tmp_path / "absent", allowed={0}) == []


@pytest.fixture
def calls(monkeypatch):
    """The ``mbind`` calls ``interleave`` makes, recorded instead of made (they succeed)."""
    made = []

    def record(start, length, mode, nodemask, maxnode):
        made.append((start, length, mode, [word for word in nodemask], maxnode))
        return 0

    monkeypatch.setattr(numa, "_mbind", record)
    return made


def test_interleave_binds_every_whole_page_of_the_buffer_to_the_nodes(calls):
    page = os.sysconf("SC_PAGE_SIZE")
    buffer = torch.empty(10 * page + 123, dtype=torch.uint8)[7:]  # a start inside a page
    assert numa.interleave(buffer, [0, 1, 65], "test")
    (start, length, mode, mask, maxnode), = calls
    end = buffer.data_ptr() + buffer.numel()
    assert start % page == 0 and length % page == 0 and length > 0
    assert buffer.data_ptr() <= start < buffer.data_ptr() + page and end - page < start + length <= end
    assert mode == numa.MPOL_INTERLEAVE and mask == [0b11, 0b10] and maxnode == 128


def test_one_node_or_a_device_buffer_is_left_alone(calls):
    assert not numa.interleave(torch.empty(1 << 20, dtype=torch.uint8), [0, 0], "test")
    assert not numa.interleave(torch.empty(0, dtype=torch.uint8), [0, 1], "test")
    assert not numa.interleave(torch.empty(1 << 20, dtype=torch.uint8, device="meta"), [0, 1], "test")
    assert calls == []


def test_a_refusal_leaves_the_pages_and_says_why_once(monkeypatch, caplog):
    numa._refused.cache_clear()
    monkeypatch.setattr(numa, "_mbind", lambda *args: 1)  # EPERM
    with caplog.at_level(logging.INFO, logger=numa.__name__):
        for _ in range(2):
            assert not numa.interleave(torch.empty(1 << 20, dtype=torch.uint8), [0, 1], "test")
    assert caplog.text.count("the kernel refused to interleave") == 1 and os.strerror(1) in caplog.text


@pytest.mark.skipif(platform.machine() not in numa.SYS_MBIND or not numa.host_nodes(),
                    reason="mbind's call number is known for Linux on x86_64 and aarch64 only")
def test_the_system_call_takes_this_hosts_node_and_refuses_an_absent_one():
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    buffer = torch.empty(4 * page, dtype=torch.uint8)
    start = (buffer.data_ptr() + page - 1) // page * page
    node = numa.host_nodes()[0]
    assert numa._mbind(start, page, numa.MPOL_INTERLEAVE, (ctypes.c_ulong * 1)(1 << node), 64) == 0
    assert numa._mbind(start, page, numa.MPOL_INTERLEAVE, (ctypes.c_ulong * 1)(1 << 63), 64) != 0
    buffer.fill_(7)  # the pages take their first writes under the policy: values as ever
    assert bool((buffer == 7).all())


def test_a_cpu_device_interleaves_its_expert_slots_and_a_ram_arena(tiny_model_factory, calls, monkeypatch):
    monkeypatch.setattr(cache_module, "placement_nodes", lambda: (0, 1))
    monkeypatch.setattr(arena_module, "placement_nodes", lambda: (0, 1))
    path = tiny_model_factory(expert_type="Q8_0")
    want = Engine.load(path, max_context=32, expert_cache=3, arena="mmap").logits([1, 2, 3])
    calls.clear()
    engine = Engine.load(path, max_context=32, expert_cache=3, arena="pinned")  # no accelerator: ordinary RAM
    buffers = [engine.experts.caches[0].padded, *(engine.experts.arena.layer_buffer(layer)
                                                  for layer in engine.spec.moe_layers)]
    def inside(call, buffer):
        start, length = call[:2]
        return buffer.data_ptr() <= start and start + length <= buffer.data_ptr() + buffer.numel()

    assert len(calls) == len(buffers)  # one call a buffer, within it (the arena's layers first, then the slots)
    assert all(sum(inside(call, buffer) for call in calls) == 1 for buffer in buffers)
    assert torch.equal(engine.logits([1, 2, 3]), want)
