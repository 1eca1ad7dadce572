"""Pytest plugin for Strata and its plugin authors (fixtures: tiny models, logical devices)."""
