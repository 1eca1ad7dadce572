"""Typed reads of one architecture's ``{arch}.*`` GGUF metadata keys, and the layers a file holds.

Every value is type- and range-checked: an integer key holding a string, a zero head count or a NaN
``rms_eps`` is a ``ModelFileError`` naming the file and the key.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from strata_core.errors import ModelFileError, UnsupportedError

__all__ = ["Metadata", "layers_present"]


class Metadata:
    """Typed reads of ``{arch}.*`` keys: each value is checked, and a problem names the file and key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: str) -> None:
        self._metadata, self._arch, self._path = metadata, arch, path

    def _raw(self, key: str, default: Any) -> tuple[str, Any]:
        full = key.format(arch=self._arch)
        if full not in self._metadata:
            if default is ...:
                raise ModelFileError(f"{self._path}: metadata key {full!r} is missing")
            return full, default
        value = self._metadata[full]
        if isinstance(value, list):  # a per-layer array: one value for every layer is a scalar
            if not value or len(set(map(repr, value))) != 1:
                raise UnsupportedError(f"{self._path}: {full} differs between layers ({value[:8]}); not supported")
            value = value[0]
        return full, value

    def _bad(self, key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{self._path}: metadata key {key!r} is {value!r}, expected {expected}")

    def int(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        """An integer >= ``minimum`` (a string or float is an error, not converted)."""
        full, value = self._raw(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self._bad(full, value, f"an integer >= {minimum}")
        return value

    def float(self, key: str, default: Any = ..., *, positive: bool = True, below: float = math.inf) -> float:
        """A finite number, > 0 when ``positive`` (else >= 0), and < ``below``."""
        full, value = self._raw(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (positive and value == 0) or value >= below:
            bound = "" if below == math.inf else f" and < {below:g}"
            raise self._bad(full, value, "a finite number " + ("> 0" if positive else ">= 0") + bound)
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        """A boolean."""
        full, value = self._raw(key, default)
        if not isinstance(value, bool):
            raise self._bad(full, value, "a boolean")
        return value

    def str(self, key: str, default: str) -> str:
        """A string."""
        full, value = self._raw(key, default)
        if not isinstance(value, str):
            raise self._bad(full, value, "a string")
        return value


def layers_present(tensors: Mapping[str, Any]) -> set[int]:
    """The layer indices ``N`` of the ``blk.N.*`` tensors."""
    out = set()
    for name in tensors:
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
            out.add(int(parts[1]))
    return out
