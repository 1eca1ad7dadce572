"""The ``gpu1_experts`` topology plugin for Strata (entry point: :mod:`strata_gpu1_experts.plugin`)."""
