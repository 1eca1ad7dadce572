"""GGUF files only: the memory-mapped reader and a writer (an architecture's reading of the metadata is in
strata_core.model)."""
