"""Parse and check ``--devices``: names that do not exist here are an error before anything loads.

An entry may name a device of another rank (process) of a multi-process engine: ``rank1:cuda:0``,
``rank1:cpu`` (strata_core/remote/); a plain name is rank 0's.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator

import torch

from strata_core.errors import ConfigError
from strata_core.plugin.placement import DeviceSlot

_RANKED = re.compile(r"rank(\d+):(.+)")


def split_rank(name: str) -> tuple[int, str]:
    """``"rank1:cuda:0"`` -> ``(1, "cuda:0")``; a plain name is rank 0's."""
    ranked = _RANKED.fullmatch(name.strip())
    return (int(ranked.group(1)), ranked.group(2)) if ranked else (0, name.strip())


def resolve_slots(names: list[str], rank: int = 0, memory: dict[tuple[int, str], int] | None = None
                  ) -> tuple[DeviceSlot, ...]:
    """The device slots of ``--devices``: this ``rank``'s entries checked to exist here (as
    :func:`resolve_devices`), another rank's only parsed (its rank checked them), with the free memory
    it reported (``memory``: ``(rank, name) -> bytes``)."""
    slots = []
    for index, entry in enumerate(names):
        owner, name = split_rank(entry)
        if owner == rank:
            (device,) = resolve_devices([name])
        else:
            device = _parse(name)
        slots.append(DeviceSlot(index, device, owner, None if owner == rank else (memory or {}).get((owner, name))))
    return tuple(slots)


def _parse(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"--devices: {name!r} is not a device name ({error})") from None


def resolve_devices(names: list[str]) -> list[torch.device]:
    """``["cpu", "cuda:0", "cuda:0"]`` -> torch devices, checked to exist (repeats are logical devices)."""
    devices = []
    for name in names:
        device = _parse(name)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if device.index is None else device.index
            if index >= count:
                raise ConfigError(f"--devices: {name} does not exist; this machine has {count} CUDA device(s)")
            device = torch.device("cuda", index)
        elif device.type != "cpu":
            raise ConfigError(f"--devices: {name!r}: only cpu and cuda devices are supported")
        devices.append(device)
    return devices


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The activations' dtype that ``--dtype`` means on ``device`` (auto: float32 on the CPU, bfloat16 else)."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device inside the block (kernels that launch on the current
    device, Triton's among them, then run where their tensors are); nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def timed_span(device: torch.device, on_events: Callable[[torch.cuda.Event, torch.cuda.Event], None],
               on_seconds: Callable[[float], None],
               clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """Time the work enqueued inside the block: on CUDA two timing events recorded around it, given to
    ``on_events`` (the caller resolves them later: no wait here); elsewhere the seconds of ``clock`` it
    took, given to ``on_seconds``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        on_events(start, end)
    else:
        t0 = clock()
        yield
        on_seconds(clock() - t0)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without making the host wait (pinned, non-blocking); a
    tensor on a device already is copied there as it is (a decode window's tokens fed on the device)."""
    device = torch.device(device)
    if host.device.type != "cpu":  # on the device's stream after what computed it; to the host: waited for
        return host.to(device, non_blocking=device.type == "cuda")
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PendingRead:
    """A small device tensor's values, copied to the host where they stand in the stream now and read
    later: the host then waits only for the work enqueued before this, not for what came after (on CUDA
    a pinned copy and an event; on the CPU a copy)."""

    def __init__(self, tensor: torch.Tensor):
        self._ready = None
        if tensor.device.type != "cuda":
            self._host = tensor.clone()
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        """The values as Python numbers, once the copy is done."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
