"""The architecture registry: GGUF ``general.architecture`` name -> ``Architecture``.

Adding an architecture = a new module defining ``ARCH`` + one line in ``_MODULES``.
"""

from __future__ import annotations

from strata_core.errors import UnsupportedError
from strata_core.gguf.arch import deepseek2, gpt_oss, qwen2moe, qwen3moe, qwen3next
from strata_core.gguf.arch.base import Architecture

__all__ = ["Architecture", "ARCHITECTURES", "get_architecture"]

_MODULES = (qwen3moe, qwen2moe, gpt_oss, qwen3next, deepseek2)

ARCHITECTURES: dict[str, Architecture] = {m.ARCH.name: m.ARCH for m in _MODULES}


def get_architecture(name: str, path: str = "") -> Architecture:
    """The registered Architecture ``name``; UnsupportedError listing the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        where = f"{path}: " if path else ""
        raise UnsupportedError(f"{where}architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
