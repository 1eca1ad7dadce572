"""What a public server meets first: drive-by browser requests, slow and half-open clients, runaway
chat templates, oversized prompts, shutdown, a model file changed under it, the CPU thread pool."""

from __future__ import annotations

import httpx
import pytest
from test_server_support import FakeEngine, live_server

from strata_core.config import StrataSettings
from strata_core.serving.server.guards import allowed_host_names, host_of

COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 2}


def _settings(**kw: object) -> StrataSettings:
    return StrataSettings(model_alias="fake", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def url() -> str:
    with live_server(_settings(allowed_hosts=["strata.lan", "*.example.org"]), FakeEngine()) as base:
        yield base


def test_a_drive_by_text_plain_post_is_refused(url: str) -> None:
    """A page on another site can POST text/plain (no CORS pre-flight): the server must not generate."""
    import json

    body = json.dumps(COMPLETION)
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": kind} if kind else {}
        response = httpx.post(f"{url}/v1/completions", content=body, headers=headers)
        assert response.status_code == 415, (kind, response.text)
        assert "application/json" in response.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_a_foreign_host_header_is_refused(url: str) -> None:
    """DNS rebinding: attacker.example resolves to 127.0.0.1; its Host header gives it away."""
    port = url.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", "example.org"):
        response = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"host": host})
        assert response.status_code == 400, host
        assert "--allowed-hosts" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", headers={"host": host}).status_code == 400
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "strata.lan",
                 f"a.example.org:{port}"):
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"host": host}).status_code == 200, host


def test_allowed_hosts_follow_the_bound_address() -> None:
    assert allowed_host_names("127.0.0.1", []) == {"127.0.0.1", "localhost", "::1"}
    assert allowed_host_names("10.0.0.5", ["box.lan"]) == {"10.0.0.5", "box.lan"}
    assert allowed_host_names("0.0.0.0", []) is None  # every address: any host, unless named
    assert allowed_host_names("0.0.0.0", ["box.lan"]) == {"box.lan", "127.0.0.1", "localhost", "::1"}
    assert allowed_host_names("127.0.0.1", ["*"]) is None
    assert [host_of(h) for h in ("[::1]:80", "A.b.:8080", "::1")] == ["::1", "a.b", "::1"]


def test_the_load_and_every_step_run_on_one_long_lived_thread(tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CPU pool belongs to the thread driving it: the load ran on a pool thread that was later
    retired, and the decode slowed sevenfold behind OpenMP workers left spinning. The server's load,
    prefills and decode windows now run on one thread, with --threads set on it first."""
    import threading

    import torch

    from strata_core.engine import Engine

    seen: dict[str, set[tuple[int, int]]] = {"load": set(), "prefill": set(), "decode": set()}

    def record(what: str) -> None:
        seen[what].add((threading.get_ident(), torch.get_num_threads()))

    load, prefill, decode = Engine.from_settings.__func__, Engine.prefill_batch, Engine.decode_window  # type: ignore[attr-defined]
    monkeypatch.setattr(Engine, "from_settings", classmethod(lambda cls, *a: (record("load"), load(cls, *a))[1]))
    monkeypatch.setattr(Engine, "prefill_batch", lambda self, *a: (record("prefill"), prefill(self, *a))[1])
    monkeypatch.setattr(Engine, "decode_window", lambda self, *a: (record("decode"), decode(self, *a))[1])
    before = torch.get_num_threads()
    try:
        with live_server(StrataSettings(model=tiny_model_factory(), model_alias="tiny", max_context=64, threads=1)) as base:
            for _ in range(20):  # tokenize on the server's other threads in between
                assert httpx.post(f"{base}/tokenize", json={"content": "the king"}).status_code == 200
            for _ in range(2):
                reply = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "The king", "max_tokens": 4})
                assert reply.status_code == 200, reply.text
    finally:
        torch.set_num_threads(before)
    threads = seen["load"] | seen["prefill"] | seen["decode"]
    assert len(threads) == 1 and all(seen.values()), seen
    assert next(iter(threads))[1] == 1  # --threads 1 was set on that thread before the load


def _slow_settings(**kw: object) -> StrataSettings:
    return _settings(header_timeout=0.5, body_timeout=0.5, **kw)


def _closed_within(sock, seconds: float) -> bytes:  # type: ignore[no-untyped-def]
    """What the server sent before closing ``sock``; fails if it is still open after ``seconds``."""
    import socket
    import time

    sock.settimeout(0.1)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the connection is still open after {seconds} s (got {got[:100]!r})")


def test_slow_and_half_open_requests_are_dropped_and_health_answers() -> None:
    """Slowloris heads, bodies shorter than their Content-Length, chunked bodies that never end: each
    gets 408 and is closed once its deadline passes; past --max-connections a socket is refused at
    once, and /health answers throughout once the stalled ones are gone."""
    import socket

    with live_server(_slow_settings(max_connections=12), FakeEngine()) as base:
        port = int(base.rsplit(":", 1)[1])

        def connect(first: bytes) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port))
            if first:
                sock.sendall(first)
            return sock

        head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        stalled = (
            [connect(b"") for _ in range(2)]  # connected, nothing sent
            + [connect(b"GET /health HTTP/1.1\r\nhost: 1") for _ in range(3)]  # a head that never ends
            + [connect(head + b"content-length: 1000\r\n\r\n{\"model\"") for _ in range(3)]  # short body
            + [connect(head + b"transfer-encoding: chunked\r\n\r\n5\r\n{\"mod\r\n") for _ in range(3)]  # endless chunks
        )
        refused = connect(b"")  # the 12th connection (with the 11 above) is still taken; the 13th is not
        over = connect(b"")
        assert b" 503 " in _closed_within(over, 2.0)
        for sock in stalled:
            assert b" 408 " in _closed_within(sock, 3.0)
        _closed_within(refused, 3.0)
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.post(f"{base}/v1/completions", json=COMPLETION).status_code == 200
        for sock in stalled + [refused, over]:
            sock.close()


def test_a_trickled_head_is_dropped_at_its_deadline() -> None:
    """A byte every 0.1 s keeps uvicorn's keep-alive timer from firing; the head deadline does not move."""
    import socket
    import time

    with live_server(_slow_settings(), FakeEngine()) as base:
        sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        start = time.monotonic()
        sock.settimeout(0.1)
        got = b""
        for byte in b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-pad: " + b"a" * 200:
            try:
                sock.send(bytes([byte]))
                got += sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if got:
                break
        assert b" 408 " in got and time.monotonic() - start < 2.0
        sock.close()


def test_sigterm_ends_every_stream_with_an_error_event_and_done_then_exits_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM used to cut every stream (an incomplete chunked read, no [DONE], tracebacks in the log)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_server_support import free_port

    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    env = {**os.environ, "STRATA_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "strata_core", "serve", "--port", str(port), "--shutdown-grace", "0",
                             "--parallel", "2"], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        body = {"model": "demo-qwen3moe-q8_0", "prompt": "And the king said", "max_tokens": 1000, "stream": True,
                "temperature": 1.0, "seed": 1, "logit_bias": {"2": -100}}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    log.seek(0)
    assert "Traceback" not in log.read()


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing() -> None:
    """The tokenizer holds the GIL for a whole encode: a 7 MB /tokenize froze /health for 10 s, 260k
    chat messages for 27 s. What cannot fit the context is refused before any encode or render."""
    from test_server_support import FakeTokenizer

    with live_server(_settings(max_body_mib=64), FakeEngine(max_context=256)) as base:
        before = FakeTokenizer.encoded
        huge = "the king " * 400_000  # 3.6 MB
        many = [{"role": "user", "content": "hi"}] * 300_000
        for route, body in (("/tokenize", {"content": huge}), ("/v1/completions", {**COMPLETION, "prompt": huge}),
                            ("/v1/chat/completions", {"model": "fake", "messages": many}),
                            ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": huge}]})):
            response = httpx.post(f"{base}{route}", json=body, timeout=30)
            assert response.status_code == 400, (route, response.text)
            assert response.json()["error"]["code"] == "context_length_exceeded"
        assert FakeTokenizer.encoded == before  # nothing was tokenized
        assert httpx.post(f"{base}/tokenize", json={"content": "the king"}).json()["tokens"]


def test_the_tokenizers_bound_never_exceeds_the_real_count() -> None:
    from strata_core.config import DEMO_MODEL
    from strata_core.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(DEMO_MODEL)
    for text in ("", "a", "<|im_start|>user\nhi<|im_end|>", "     " * 50, "é中文🙂" * 30, "=" * 300, "the king " * 99):
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False)), text


RUNAWAY = (
    "{%- set c = messages[-1]['content'] %}"
    "{%- if c == 'loop' %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{%- elif c == 'huge' %}{{ c|center(2**34) }}"
    "{%- elif c == 'product' %}{{ 'a' * 2**34 }}"
    "{%- elif c == 'wide' %}{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}"
    "{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{{ '<|im_start|>assistant\\n' }}"
)


def _chat(base: str, content: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout,
                      json={"model": "fake", "messages": [{"role": "user", "content": content}], "max_tokens": 2})


def _template_engine() -> FakeEngine:
    from strata_core.text.chat import ChatTemplate

    engine = FakeEngine()
    engine.chat = ChatTemplate(RUNAWAY)  # type: ignore[assignment]
    return engine


def test_a_runaway_chat_template_is_stopped_with_a_clear_error() -> None:
    """A template looping 10^10 times hung its request for ever (and its thread spun); one asking for
    'a' * 2**34 was a MemoryError 500; a 100 MB prompt took the RSS to gigabytes. Each is now a 500
    naming the template and its bound, and the server goes on."""
    import concurrent.futures
    import time

    with live_server(_settings(template_timeout=1.0, template_max_mib=1), _template_engine()) as base:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda c: _chat(base, c), ["loop", "huge", "wide"]))
        assert time.monotonic() - start < 8
        product = _chat(base, "product")  # refused before it runs (jinja2 would fold it while compiling)
        assert product.status_code == 400 and "sequence of 17179869184 items" in product.json()["error"]["message"]
        messages = [r.json()["error"]["message"] for r in replies]
        assert all(r.status_code == 500 and r.json()["error"]["code"] == "chat_template_limit" for r in replies), messages
        assert all("chat template" in m for m in messages)
        assert "within 1 s (--template-timeout)" in messages[0]
        assert "memory" in messages[1]
        assert "more than 1048576 characters (--template-max-mib)" in messages[2]
        assert _chat(base, "fine").status_code == 200


def test_a_template_render_stops_when_its_client_goes_away() -> None:
    """41 abandoned runaway renders used to fill the worker pool; an abandoned render is now stopped."""
    import time

    with live_server(_settings(template_timeout=60), _template_engine()) as base:
        for _ in range(3):  # more than the template processes: each is stopped when its client leaves
            with pytest.raises(httpx.ReadTimeout):
                _chat(base, "loop", timeout=0.3)
        start = time.monotonic()
        assert _chat(base, "fine").status_code == 200
        assert time.monotonic() - start < 5
        assert httpx.post(f"{base}/tokenize", json={"content": "x"}).status_code == 200


def test_a_model_file_cut_short_under_the_server_is_an_error_not_sigbus(tiny_model_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With --expert-cache 0 every decode reads the mmap'd experts; a file truncated under the server
    killed it with SIGBUS (here: pytest itself). Now the request fails, /health says why, nothing dies."""
    import os
    import shutil

    path = tmp_path / "served.gguf"
    shutil.copy(tiny_model_factory(), path)
    settings = StrataSettings(model=path, model_alias="tiny", max_context=64, expert_cache=0, arena="mmap")
    with live_server(settings) as base:
        body = {"model": "tiny", "prompt": "The king", "max_tokens": 3}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200
        os.truncate(path, path.stat().st_size // 2)
        for _ in range(2):
            reply = httpx.post(f"{base}/v1/completions", json=body)
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert error["code"] == "model_file_changed" and str(path) in error["message"] and "cut" in error["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "error" and str(path) in health.json()["error"]


def _leases_work(tmp_path) -> bool:  # type: ignore[no-untyped-def]
    import fcntl
    import os

    if not hasattr(fcntl, "F_SETLEASE"):
        return False
    probe = tmp_path / "lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_model_file_cut_during_a_stream_waits_on_the_lease_and_the_stream_fails(tiny_model_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A cut during a step could still SIGBUS: the read lease holds the truncate until the server has
    stopped using the file; the stream ends with an error event, /health is 503, the truncate returns."""
    import json
    import os
    import shutil
    import threading

    from strata_core.serving import model_files

    if not _leases_work(tmp_path):
        pytest.skip("read leases (F_SETLEASE) are unavailable here")
    if not model_files._install_handler():
        pytest.skip("the SIGIO handler is not installed (not imported on the main thread)")
    path = tmp_path / "served.gguf"
    shutil.copy(tiny_model_factory(), path)
    settings = StrataSettings(model=path, model_alias="tiny", max_context=512, expert_cache=0, arena="mmap")
    cut = threading.Thread(target=os.truncate, args=(path, path.stat().st_size // 2), daemon=True)
    with live_server(settings) as base:
        body = {"model": "tiny", "prompt": "The king", "max_tokens": 400, "stream": True, "temperature": 1.0,
                "seed": 1}
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    cut.start()  # blocks in the kernel until the server gives the lease up
        cut.join(30)  # the lease break time is 45 s by default: returning sooner means it was released
        assert not cut.is_alive(), "the truncate still waits on the lease"
        assert path.stat().st_size > 0
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "model_file_changed" and str(path) in error["message"], error
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "error" and str(path) in health.json()["error"]
        reply = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "The king", "max_tokens": 3})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_file_changed"
