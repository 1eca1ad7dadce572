"""The model's files, watched while they are served.

The weights are memory-mapped: if a file is cut short under a running server (``cp`` over it, a
failed download restarted in place), the next read of a page past its new end kills the process
with SIGBUS, which Python cannot catch. The scheduler therefore checks, before every engine step,
that each mapped file (the inode that is mapped, through a descriptor held open) still has the size
and modification time it had at load; if not, the server stops using the model: every request gets
:class:`ModelFileChangedError` (503) and ``/health`` answers 503 ``{"status": "error"}`` until it is
restarted. A file replaced by a rename is a new inode and harms nothing; it is not reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from strata_core.errors import StrataError

__all__ = ["ModelFileChangedError", "ModelFiles"]


class ModelFileChangedError(StrataError):
    """A file the model is mapped from changed on disk while it was served (HTTP 503)."""


class ModelFiles:
    """Open descriptors on ``paths`` and their size and mtime when opened."""

    def __init__(self, paths: Iterable[str]) -> None:
        self._files: list[tuple[str, int, tuple[int, int]]] = []
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            st = os.fstat(fd)
            self._files.append((path, fd, (st.st_size, st.st_mtime_ns)))

    def changed(self) -> ModelFileChangedError | None:
        """The error for the first file whose size or mtime changed since load, else None."""
        for path, fd, (size, mtime) in self._files:
            st = os.fstat(fd)
            if st.st_size != size or st.st_mtime_ns != mtime:
                what = f"was cut from {size} to {st.st_size} bytes" if st.st_size < size else "was modified"
                return ModelFileChangedError(f"the model file {path} {what} while it was served; the server stopped "
                                             "using it (restart it to load the file again)")
        return None

    def close(self) -> None:
        for _, fd, _ in self._files:
            os.close(fd)
        self._files = []
