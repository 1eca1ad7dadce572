"""``strata serve`` started in a subprocess for ``strata bench serve``, on a free port, ready when its
``/health`` answers 200."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from strata_core.tools.bench_serve import BenchServeError

__all__ = ["free_port", "setting_env", "strata_server"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def setting_env(name: str, value: Any) -> str | None:
    """A setting's value as its ``STRATA_*`` variable reads it (None: leave the variable unset)."""
    if value is None:
        return None
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return os.fspath(value) if isinstance(value, Path) else str(value)


@contextlib.contextmanager
def strata_server(settings: dict[str, Any], startup_timeout: float = 900.0) -> Iterator[str]:
    """Run ``strata serve`` with ``settings`` (setting name -> value, passed as ``STRATA_*`` variables)
    in a subprocess, its log in a file; yield its base URL once ``/health`` answers 200, and stop it
    after. A server that exits or does not become ready in ``startup_timeout`` seconds is an error with
    the last line of its log."""
    env = dict(os.environ)
    for name, value in settings.items():
        text = setting_env(name, value)
        if text is None:
            env.pop(f"STRATA_{name.upper()}", None)
        else:
            env[f"STRATA_{name.upper()}"] = text
    host = "127.0.0.1" if settings.get("host") in (None, "0.0.0.0", "::") else settings["host"]
    url = f"http://{host}:{settings.get('port')}"
    log_file = tempfile.NamedTemporaryFile("w+", prefix="strata-serve-", suffix=".log", delete=False)
    log.info("bench serve: starting strata serve at %s (log in %s)", url, log_file.name)
    process = subprocess.Popen([sys.executable, "-m", "strata_core", "serve"], env=env, stdout=log_file,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ok = False
    try:
        _wait_ready(process, url, Path(log_file.name), startup_timeout)
        yield url
        ok = True
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log_file.close()
        if ok:  # kept, and named in the error, when something went wrong
            Path(log_file.name).unlink(missing_ok=True)


def _wait_ready(process: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise BenchServeError(f"strata serve exited with status {process.returncode}: "
                                      f"{_last_line(log_path)} (log: {log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise BenchServeError(f"strata serve was not ready after {timeout:.0f} s (log: {log_path})")
            time.sleep(0.1)  # polling for readiness, nothing is timed here


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"
