"""Host-link class of each CUDA device (PCIe generation x lanes), from NVML or sysfs."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: GT/s of PCIe generation 1..6 as sysfs writes it, to the generation
_SPEEDS = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


def _nvml_link(index: int) -> tuple[int, int] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(_bus_id(index).encode())
        return (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except pynvml.NVMLError:
        return None


def _bus_id(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def _sysfs_link(index: int) -> tuple[int, int] | None:
    path = Path("/sys/bus/pci/devices") / _bus_id(index)
    try:
        speed = (path / "max_link_speed").read_text().split()[0]
        return _SPEEDS[speed], int((path / "max_link_width").read_text())
    except (OSError, KeyError, ValueError, IndexError):
        return None


def link_class(device: torch.device) -> tuple[int, int] | None:
    """(PCIe generation, lanes) of ``device``'s host link, or None where it cannot be probed (the CPU,
    a machine without NVML or sysfs entries)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index or 0
    try:
        return _nvml_link(index) or _sysfs_link(index)
    except (RuntimeError, AttributeError) as error:  # no properties for this device
        log.debug("link probe of %s failed: %s", device, error)
        return None
