"""The CPU kernels build wherever a C++ compiler and ninja are: a build error fails here, rather than
turning every kernel test into a skip and the engine's CPU paths into the torch reference unseen; and a
killed build's lock does not hang the next load."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
from torch.utils.cpp_extension import is_ninja_available

from strata_core.ops.cpu_kernels import STALE_LOCK_S, clear_stale_lock, cpu_kernels


@pytest.mark.skipif(os.environ.get("STRATA_CPU_KERNELS") == "0" or shutil.which("c++") is None
                    or not is_ninja_available(), reason="no C++ compiler or ninja here, or the kernels turned off")
def test_the_cpu_kernels_build_where_a_compiler_is():
    assert cpu_kernels(), "the CPU kernels did not build: the warning above says why"


def test_a_killed_build_s_lock_is_removed_and_a_live_one_kept(tmp_path, caplog):
    """A build lock older than ``STALE_LOCK_S`` (a killed build's, which torch's loader would wait on forever)
    is removed with a warning; a younger one (a build in progress) is left alone."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        assert clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do
