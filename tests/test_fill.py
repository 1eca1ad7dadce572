"""The arena fill: every byte of every run lands where it belongs, whatever the threads, chunk and
sizes; the tasks cover the runs exactly; the pinned-allocator settings respect the user's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from strata_core.experts import fill
from strata_core.experts.fill import FillReport, copy_tasks, fill_packed


def _runs(rng: np.random.Generator, shapes: list[tuple[int, int]]) -> tuple[np.ndarray, list, np.ndarray]:
    """A packed destination ``[rows, sum(widths)]`` and the runs filling each column range from its own
    source (as the arena lays gate|up|down of every expert side by side); the expected bytes."""
    rows = shapes[0][0]
    sources = [rng.integers(0, 256, size=(rows, width), dtype=np.uint8) for _, width in shapes]
    dst = np.zeros((rows, sum(w for _, w in shapes)), dtype=np.uint8)
    runs, col = [], 0
    for src in sources:
        runs.append((dst[:, col:col + src.shape[1]], src))
        col += src.shape[1]
    return dst, runs, np.concatenate(sources, axis=1)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), widths=st.lists(st.integers(1, 700), min_size=1, max_size=4),
       chunk=st.integers(1, 3000), threads=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 2**16))
def test_filled_bytes_equal_the_sources(rows, widths, chunk, threads, seed):
    dst, runs, want = _runs(np.random.default_rng(seed), [(rows, w) for w in widths])
    reported: list[int] = []
    fill_packed(runs, threads, reported.append, chunk=chunk)
    assert np.array_equal(dst, want)
    assert sum(reported) == want.nbytes  # progress adds up to the bytes, once each


@given(rows=st.integers(1, 6), width=st.integers(1, 500), chunk=st.integers(1, 900))
def test_tasks_cover_each_byte_once_in_chunks(rows, width, chunk):
    dst = np.zeros((rows, width), dtype=np.uint8)
    tasks = copy_tasks([(dst, np.ones_like(dst))], chunk)
    for task in tasks:
        assert sum(d.nbytes for d, _ in task) <= chunk
        for d, _ in task:
            d += 1  # every byte of the destination exactly once
    assert np.all(dst == 1)


def test_a_run_of_unequal_shapes_is_refused():
    with pytest.raises(ValueError, match="one shape"):
        copy_tasks([(np.zeros(4, np.uint8), np.zeros(5, np.uint8))])


def test_a_pinned_torch_buffer_fills_from_a_memory_map(tmp_path):
    """The arena's case: a file mapped read-only into a torch buffer's column ranges, odd sizes."""
    data = np.random.default_rng(0).integers(0, 256, size=3 * 1001, dtype=np.uint8)
    data.tofile(tmp_path / "blob")
    mapped = np.memmap(tmp_path / "blob", dtype=np.uint8, mode="r").reshape(3, 1001)
    buf = torch.empty((3, 1001 + 7), dtype=torch.uint8)
    buf[:, 1001:] = 9
    fill_packed([(buf.numpy()[:, :1001], mapped)], threads=2, chunk=333)
    assert np.array_equal(buf.numpy()[:, :1001], mapped)
    assert bool((buf[:, 1001:] == 9).all())  # nothing past the run is touched


def test_the_report_line():
    line = FillReport(3 << 30, 8, 0.5, 1.5).message()
    assert line == "arena: 3.00 GiB filled in 2.0 s (1.61 GB/s, 8 threads; allocating 0.5 s, copying 1.5 s)"


@pytest.fixture
def allocator(monkeypatch):
    """A CUDA-present torch whose allocator settings are recorded (and reject the keys in ``refused``)."""
    calls: list[str] = []
    refused: set[str] = set()

    def set_settings(text: str) -> None:
        calls.append(text)
        if any(key in text for key in refused):
            raise ValueError(f"Unrecognized key in {text}")  # as torch 2.11 refuses a key it does not know

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", set_settings, raising=False)
    for name in fill.ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    return calls, refused


def test_pinned_allocator_settings_are_set_where_cuda_is(allocator):
    calls, _ = allocator
    assert fill.configure_pinned_allocator.__wrapped__() == ",".join(fill.PINNED_KEYS)
    assert calls == [",".join(fill.PINNED_KEYS)]
    assert "pinned_use_cuda_host_register:True" in calls[0] and "pinned_num_register_threads:8" in calls[0]


def test_an_older_torch_gets_the_keys_it_knows(allocator):
    calls, refused = allocator
    refused.add("pinned_max_round_threshold_mb")
    assert fill.configure_pinned_allocator.__wrapped__() == ",".join(fill.PINNED_KEYS[:2])


@pytest.mark.parametrize("name", fill.ALLOC_ENV)
def test_the_users_allocator_settings_are_left_alone(allocator, monkeypatch, name):
    calls, _ = allocator
    monkeypatch.setenv(name, "expandable_segments:True")
    assert fill.configure_pinned_allocator.__wrapped__() is None and calls == []


def test_no_settings_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fill.configure_pinned_allocator.__wrapped__() is None
