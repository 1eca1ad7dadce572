"""GGUF files: the memory-mapped reader, architecture metadata -> ModelSpec, and a writer."""
