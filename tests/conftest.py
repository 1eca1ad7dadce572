"""Test-suite settings: hypothesis runs derandomized (CI sees the same examples every run) and
without per-example deadlines (a shared 2-core machine is slow in bursts)."""

from hypothesis import settings

settings.register_profile("strata", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("strata")
