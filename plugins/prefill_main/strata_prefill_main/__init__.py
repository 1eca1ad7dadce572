"""The ``prefill_main`` topology plugin for Strata (entry point: :mod:`strata_prefill_main.plugin`)."""
