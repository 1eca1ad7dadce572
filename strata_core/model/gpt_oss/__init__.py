"""The gpt-oss architecture: ``spec.py`` (its ModelSpec), ``architecture.py`` (metadata -> spec, ``ARCH``),
``forward.py`` (its forward), ``preset.py`` (its synthetic shapes)."""
