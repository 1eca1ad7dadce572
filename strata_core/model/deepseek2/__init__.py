"""The deepseek2 architecture: ``spec.py`` (its ModelSpec), ``architecture.py`` (metadata -> spec, ``ARCH``),
``forward.py`` (its forward), ``preset.py`` (its synthetic shapes)."""
