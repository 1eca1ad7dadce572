"""Chat templates rendered in child processes, bounded in time and in output size.

A chat template is a program: ``{% for i in range(99999) %}{% for j in range(99999) %}`` runs for
hours, a ``'a' * 2**34`` asks for 16 GiB, and jinja2's sandbox bounds neither. A thread cannot be
stopped from outside, and a cooperative check inside the render misses a single huge C-level
operation (a string product, a ``center(10**10)``); a process can be killed. So the server renders in
a few small child processes (``python -m strata_core.text.template_process``: jinja2 only, no
torch), each limited to ``memory_bytes`` of address space: past ``timeout`` seconds, or when its
request is cancelled, the child is killed (and replaced on the next use); output past ``max_chars``
stops the render; a MemoryError stays in the child. Each is a clear :class:`TemplateLimitError`.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from strata_core.errors import RequestError, StrataError, TemplateCancelled, TemplateLimitError
from strata_core.text.chat import ChatTemplate

__all__ = ["TemplateProcesses"]

_HEADER = struct.Struct("<Q")


def _send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None, cancelled: threading.Event | None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if cancelled is not None and cancelled.is_set():
            raise TemplateCancelled("the request was cancelled while its chat template rendered")
        wait = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError("the template process ended")
            out += chunk
    return bytes(out)


class _Child:
    def __init__(self, memory_bytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "strata_core.text.template_process", str(memory_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class TemplateProcesses:
    """Renders ``source`` (a chat template, with its ``bos``/``eos`` texts) in up to ``workers`` children."""

    def __init__(self, source: str, bos: str, eos: str, *, timeout: float, max_chars: int, memory_bytes: int,
                 workers: int = 2, name: str = "the chat template") -> None:
        self.template = (source, bos, eos)
        self.timeout, self.max_chars, self.memory_bytes, self.name = timeout, max_chars, memory_bytes, name
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._slots = threading.Semaphore(workers)
        self._closed = False
        self._idle.put(_Child(memory_bytes))  # started now, so the first request does not wait for it

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               cancelled: threading.Event | None = None, **kwargs: Any) -> str:
        """The prompt text (blocking; call it off the event loop). Raises TemplateLimitError past the
        bounds, TemplateCancelled once ``cancelled`` is set, RequestError for a template error."""
        deadline = time.monotonic() + self.timeout
        if not self._slots.acquire(timeout=self.timeout):
            raise TemplateLimitError(f"{self.name} is busy rendering other requests past {self.timeout:g} s "
                                     "(--template-timeout); retry later")
        try:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                child = _Child(self.memory_bytes)
            try:
                _send(child.proc.stdin, (self.template, messages, add_generation_prompt, kwargs, self.max_chars))
                fd = child.proc.stdout.fileno()  # type: ignore[union-attr]
                size = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline, cancelled))[0]
                status, value = pickle.loads(_read_exact(fd, size, None, cancelled))
            except TimeoutError:
                child.kill()
                raise TemplateLimitError(f"{self.name} did not finish within {self.timeout:g} s (--template-timeout); "
                                         "it was stopped") from None
            except BaseException:
                child.kill()
                raise
            self._idle.put(child)
        finally:
            self._slots.release()
        if status == "ok":
            return value
        if status == "limit":
            raise TemplateLimitError(f"{self.name} {value}")
        raise RequestError(value)

    def close(self) -> None:
        """Stop every idle child."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


def _child_main(memory_bytes: int) -> None:
    """The child: render requests from stdin, answer on stdout, until stdin closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    templates: dict[tuple[str, str, str], ChatTemplate] = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        (key, messages, add_generation_prompt, kwargs, max_chars) = pickle.loads(stdin.read(_HEADER.unpack(header)[0]))
        try:
            if key not in templates:
                templates[key] = ChatTemplate(key[0], bos_token=key[1], eos_token=key[2])
            answer = ("ok", templates[key].render(messages, add_generation_prompt, max_chars=max_chars, **kwargs))
        except MemoryError:
            answer = ("limit", "needed more memory than its bound allows; it was stopped")
        except StrataError as exc:
            answer = ("limit" if isinstance(exc, TemplateLimitError) else "error", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the request
            answer = ("error", f"the chat template failed on the messages: {type(exc).__name__}: {exc}")
        _send(stdout, answer)


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
