"""Modules that sit on both sides of the ops / experts import cycle import on their own, first in a fresh
interpreter (a tool or a plugin may import any of them before the package's usual entry points)."""

from __future__ import annotations

import subprocess
import sys

import pytest

FIRST = ["strata_core.experts.cpu_ffn", "strata_core.experts.ffn", "strata_core.model.transformer"]


@pytest.mark.parametrize("module", FIRST)
def test_a_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
