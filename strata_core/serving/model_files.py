"""The model's files, watched while they are served.

The weights are memory-mapped: if a file is cut short under a running server (``cp`` over it, a
failed download restarted in place), the next read of a page past its new end kills the process
with SIGBUS, which Python cannot catch. The scheduler therefore checks, before every engine step,
that each mapped file (the inode that is mapped, through a descriptor held open) still has the size
and modification time it had at load; if not, the server stops using the model: every request gets
:class:`ModelFileChangedError` (503) and ``/health`` answers 503 ``{"status": "error"}`` until it is
restarted. A file replaced by a rename is a new inode and harms nothing; it is not reported.

A cut *during* a step would still be a SIGBUS, so on Linux each file also gets a read lease
(``F_SETLEASE F_RDLCK``; needs the file's owner or CAP_LEASE). Then another process's open for
writing or truncate blocks (up to ``/proc/sys/fs/lease-break-time``) and the kernel sends SIGIO; the
handler (installed at import, on the main thread) only flags it and wakes the scheduler, which at its
next step boundary (an idle one at once, or within a second) marks the model changed exactly as above
and only then releases the leases (:meth:`ModelFiles.release`), so the writer goes on while nothing
reads the mapping any more. Where no lease can be taken (EACCES, EAGAIN, EINVAL, not Linux, no handler)
this is logged once and the size/mtime check alone remains.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

from strata_core.errors import StrataError

__all__ = ["ModelFileChangedError", "ModelFiles"]

log = logging.getLogger(__name__)

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", None)
_SIGIO = getattr(signal, "SIGIO", None)
_live: list[ModelFiles] = []  # the instances holding leases: whom a SIGIO wakes
_warned = False


def _on_sigio(signum: int, frame: object) -> None:
    """A lease is being broken: only flag it and wake the watchers (they act on their own thread)."""
    for files in list(_live):  # noqa: PERF101 - a copy: release() may remove one meanwhile
        files._signalled.set()
        if files._on_break is not None:
            files._on_break()  # e.g. SimpleQueue.put: safe in a signal handler


def _install_handler() -> bool:
    """Install the SIGIO handler (only possible on the main thread); True once it is installed."""
    if _SIGIO is None or _F_SETLEASE is None:
        return False
    if signal.getsignal(_SIGIO) is _on_sigio:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(_SIGIO, _on_sigio)
    return True


_install_handler()  # at import, normally on the main thread (servers load the model on another)


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("no read lease on the model files (%s): a file cut short during an engine step can "
                    "still kill the server with SIGBUS; it is checked between steps", why)


class ModelFileChangedError(StrataError):
    """A file the model is mapped from changed on disk while it was served (HTTP 503)."""


class ModelFiles:
    """Open descriptors on ``paths``, their size and mtime when opened, and read leases where possible.

    ``on_break`` is called (from the SIGIO handler) when a writer starts breaking a lease."""

    def __init__(self, paths: Iterable[str], on_break: Callable[[], None] | None = None) -> None:
        self._files: list[tuple[str, int, tuple[int, int]]] = []
        self._on_break = on_break
        self._signalled = threading.Event()
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            st = os.fstat(fd)
            self._files.append((path, fd, (st.st_size, st.st_mtime_ns)))
        self.leased = self._take_leases()

    def _take_leases(self) -> bool:
        if _F_SETLEASE is None or _SIGIO is None:
            _warn_once("not Linux")
            return False
        if not _install_handler():
            _warn_once("the SIGIO handler could not be installed off the main thread")
            return False
        taken: list[int] = []
        try:
            for _, fd, _ in self._files:
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
                taken.append(fd)
        except OSError as exc:
            for fd in taken:
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
            _warn_once(errno.errorcode.get(exc.errno or 0, str(exc)))
            return False
        _live.append(self)
        return True

    @property
    def breaking(self) -> bool:
        """Whether a writer waits on a lease (SIGIO came, or the kernel reports the lease breaking)."""
        if not self.leased:
            return False
        if self._signalled.is_set():
            return True
        return any(fcntl.fcntl(fd, _F_GETLEASE) != fcntl.F_RDLCK for _, fd, _ in self._files)

    def changed(self) -> ModelFileChangedError | None:
        """The error for the first file being written to (a lease breaking) or whose size or mtime
        changed since load, else None. Call :meth:`release` once nothing reads the mapping again."""
        if self.breaking:
            names = ", ".join(path for path, _, _ in self._files)
            return ModelFileChangedError(f"the model file {names} was opened for writing or cut while it was "
                                         "served; the server stopped using it (restart it to load the file again)")
        for path, fd, (size, mtime) in self._files:
            st = os.fstat(fd)
            if st.st_size != size or st.st_mtime_ns != mtime:
                what = f"was cut from {size} to {st.st_size} bytes" if st.st_size < size else "was modified"
                return ModelFileChangedError(f"the model file {path} {what} while it was served; the server stopped "
                                             "using it (restart it to load the file again)")
        return None

    def release(self) -> None:
        """Give the leases up, so a waiting writer proceeds (nothing may read the mapping after)."""
        if self.leased:
            self.leased = False
            if self in _live:
                _live.remove(self)
            for _, fd, _ in self._files:
                try:
                    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
                except OSError:
                    pass

    def close(self) -> None:
        self.release()
        for _, fd, _ in self._files:
            os.close(fd)
        self._files = []
