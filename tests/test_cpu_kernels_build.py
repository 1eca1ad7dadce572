"""The CPU kernels build wherever a C++ compiler and ninja are: a build error fails here, rather than
turning every kernel test into a skip and the engine's CPU paths into the torch reference unseen."""

from __future__ import annotations

import os
import shutil

import pytest
from torch.utils.cpp_extension import is_ninja_available

from strata_core.ops.cpu_kernels import cpu_kernels


@pytest.mark.skipif(os.environ.get("STRATA_CPU_KERNELS") == "0" or shutil.which("c++") is None
                    or not is_ninja_available(), reason="no C++ compiler or ninja here, or the kernels turned off")
def test_the_cpu_kernels_build_where_a_compiler_is():
    assert cpu_kernels(), "the CPU kernels did not build: the warning above says why"
