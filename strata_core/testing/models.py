"""Tiny model files for tests (being written)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModelOptions:
    """Sizes and block types of a tiny test model."""

    expert_type: str = "F32"


def write_tiny_model(path: Path, options: TinyModelOptions) -> Path:
    """Write a tiny qwen3moe GGUF to ``path``."""
    raise NotImplementedError
