"""Test helpers for Strata and its plugins; the fixtures live in :mod:`strata_core.testing.plugin`."""
