"""The ``layer_split`` topology plugin for Strata (entry point: :mod:`strata_layer_split.plugin`)."""
