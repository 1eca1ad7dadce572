"""``PendingRead``: a device tensor's values as they stood when the read was made, without waiting for later work."""

import pytest
import torch

from strata_core.runtime.devices import PendingRead


def test_the_values_are_those_at_the_read_not_after():
    counts = torch.tensor([3, 0, 5])
    read = PendingRead(counts)
    counts.add_(1)  # work after the read
    assert read.tolist() == [3, 0, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_on_cuda_the_read_waits_for_the_work_before_it_only():
    torch.cuda._sleep(1)  # the kernel's module loaded now: a lazy load would wait for the device below
    counts = torch.arange(8, device="cuda").cumsum(0)  # work before the read
    read = PendingRead(counts)
    torch.cuda._sleep(2_000_000_000)  # a long kernel enqueued after the read (about a second)
    later = torch.cuda.Event()
    later.record()
    assert read.tolist() == torch.arange(8).cumsum(0).tolist()
    assert not later.query(), "the read waited for the work enqueued after it"
    torch.cuda.synchronize()
