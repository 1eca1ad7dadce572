"""Strata: run Mixture-of-Experts GGUF models larger than your GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "StrataSettings"]

if TYPE_CHECKING:
    from strata_core.config import StrataSettings
    from strata_core.engine import Engine


def __getattr__(name: str) -> Any:
    """Import the heavy modules on first use, so ``strata --help`` stays fast."""
    if name == "Engine":
        from strata_core.engine import Engine

        return Engine
    if name == "StrataSettings":
        from strata_core.config import StrataSettings

        return StrataSettings
    raise AttributeError(name)
