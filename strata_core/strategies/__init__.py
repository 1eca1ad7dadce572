"""Builtin strategies (``single``), registered through the same hook as third-party ones."""
