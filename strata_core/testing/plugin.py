"""Pytest plugin for Strata and its plugin authors (registered through the ``pytest11`` entry point).

Fixtures:

* ``plugin_manager`` — a fresh plugin manager with the builtins only (no entry-point autoload).
* ``register_strategy`` — register a strategy plugin module/object on that manager; undone after the test.
* ``tiny_model_path`` — a tiny qwen3moe GGUF, parametrised over ``TINY_MODEL_TYPES``.
* ``tiny_model_factory`` — build a tiny model file with chosen sizes and block types.
* ``logical_devices`` — ``["cpu", "cpu"]``, plus ``["cuda:0", "cuda:0"]`` where CUDA exists: every
  topology runs on logical devices.
* ``float_cpu_kernels`` — the CPU expert kernels on their float bodies for the test
  (:mod:`strata_core.testing.cpu_isa`): for comparisons of a CPU-kernel path with a float reference,
  which the int8 body (AVX-512 VNNI) meets only within the CUDA q8 kernels' tolerance.

Helpers:

* :func:`strata_core.testing.sync.no_host_sync` — checks on CUDA that a decode window enqueues its
  work without a host synchronisation; :class:`strata_core.testing.sync.HostReads` counts host reads
  on any device.
* :func:`strata_core.testing.residency.check_tiers` — checks that no two device slots' caches hold
  the same expert, and each only layers its placement serves.
* :func:`strata_core.testing.residency.single_holds` — the experts ``single`` caches with N slots:
  what a tiered strategy's caches must hold together.
* :func:`strata_core.testing.models.tiny_spec` — the ``ModelSpec`` of a model file, for testing a
  placement function without an engine.
* :func:`strata_core.testing.contract.strict_context` — runs the phase hooks with a ``ctx`` that
  answers only ``PhaseContext``'s members.

Settings: the plugin sets ``STRATA_PCIE_FRAC=1`` for the test session (unless the environment sets it):
under the default ``--pcie-frac auto`` a GPU decoding with misses splits them by timings measured in
its first windows, so which path a test exercises would depend on the machine's speed; a test of
``auto`` passes ``pcie_frac="auto"`` itself.

A plugin and its tests import only ``strata_core.plugin``, ``strata_core.testing`` and the public
``strata_core.Engine`` (``tests/test_plugin_contract.py`` checks it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.plugin.manager import StrataPluginManager, build_plugin_manager
from strata_core.testing.models import TinyModelOptions, write_tiny_model

TINY_MODEL_TYPES = ("F32", "F16", "Q8_0")


def pytest_configure(config: pytest.Config) -> None:
    """Fix the decode split of misses for the session (see the module docstring)."""
    os.environ.setdefault("STRATA_PCIE_FRAC", "1")


@pytest.fixture
def plugin_manager() -> StrataPluginManager:
    """A plugin manager with the builtin strategies and no entry-point plugins."""
    return build_plugin_manager(StrataSettings(disable_plugin_autoload=True))


@pytest.fixture
def register_strategy(plugin_manager: StrataPluginManager) -> Iterator[Callable[[object, str], None]]:
    """``register_strategy(plugin, name)`` registers a strategy plugin; unregistered after the test."""
    added: list[object] = []

    def register(plugin: object, name: str, distribution: str = "test") -> None:
        plugin_manager.register_plugin(plugin, name=name, distribution=distribution)
        added.append(plugin)

    yield register
    for plugin in added:
        if plugin_manager.is_registered(plugin):
            plugin_manager.unregister(plugin)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model_factory(**TinyModelOptions fields) -> path``; files are cached per options."""
    cache: dict[TinyModelOptions, Path] = {}
    root = tmp_path_factory.mktemp("strata-tiny-models")

    def make(**options: object) -> Path:
        key = TinyModelOptions(**options)  # type: ignore[arg-type]
        if key not in cache:
            cache[key] = write_tiny_model(root / f"tiny-{len(cache)}.gguf", key)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=TINY_MODEL_TYPES)
def tiny_model_path(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny qwen3moe GGUF whose expert tensors use each of ``TINY_MODEL_TYPES`` in turn."""
    return tiny_model_factory(expert_type=request.param)


def _logical_device_sets() -> list[list[str]]:
    sets = [["cpu", "cpu"]]
    if torch.cuda.is_available():
        sets.append(["cuda:0", "cuda:0"])
    return sets


@pytest.fixture(params=_logical_device_sets(), ids=lambda devices: ",".join(devices))
def logical_devices(request: pytest.FixtureRequest) -> list[str]:
    """Two logical devices on one physical device (cpu,cpu; cuda:0,cuda:0 where CUDA exists)."""
    return list(request.param)


@pytest.fixture
def float_cpu_kernels() -> Iterator[None]:
    """The CPU expert kernels capped at their float bodies for the test, the cap before restored after."""
    from strata_core.testing.cpu_isa import float_cpu_bodies  # the kernels' module only where a test asks

    with float_cpu_bodies():
        yield
