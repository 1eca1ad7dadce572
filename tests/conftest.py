"""Test-suite settings: hypothesis runs derandomized (CI sees the same examples every run) and
without per-example deadlines (a shared 2-core machine is slow in bursts)."""

import pytest
import torch
from hypothesis import settings

settings.register_profile("strata", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("strata")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny matmuls: on an oversubscribed 2-core box OpenMP
    spinning costs ~40 ms per product with 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
