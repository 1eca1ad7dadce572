"""What a new user of the `strata` command meets: per-command settings, one-line errors with exit
status 2 (in `serve` too), short flags, --version, the context note, `info` on split models."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_gguf_split import split_copy

from strata_core.cli import main


@pytest.fixture
def strata(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, one_thread: None):
    """``strata(*args, env={...})`` runs the command in this process: its exit status and output."""

    def run(*args: str, env: dict[str, str] | None = None) -> SimpleNamespace:
        handlers = list(logging.root.handlers)
        with monkeypatch.context() as patch:
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse: --help, unknown flags
                code = exit_.code
            finally:  # main's log handler writes to this test's captured stderr: drop it
                logging.root.handlers[:] = handlers
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


def one_line_error(result: SimpleNamespace, *words: str) -> str:
    """The run failed with status 2 and one line naming ``words``, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("strata: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(expert_type="Q8_0")


def test_each_command_shows_only_its_own_settings(strata) -> None:
    plugins, serve, generate = (strata(cmd, "--help").stdout for cmd in ("plugins", "serve", "generate"))
    assert "--plugins" in plugins and "--api-key" not in plugins and "--model" not in plugins
    assert "--api-key" in serve and "--port" in serve and "--prompt" not in serve
    assert "--prompt" in generate and "--port" not in generate and "--api-key" not in generate
    one_line_error(strata("plugins", "--api-key", "x"), "unrecognized arguments", "--api-key")


def test_a_settings_key_of_one_command_does_not_break_another(strata, model: Path, tmp_path: Path) -> None:
    config = tmp_path / "strata.toml"
    config.write_text("max_tokens = 2\ntemperature = 0.0\nmax_context = 64\n")
    env = {"STRATA_CONFIG": str(config)}
    assert strata("plugins", env=env).returncode == 0
    info = strata("info", str(model), env=env)
    assert info.returncode == 0 and "context: 64 tokens used" in info.stdout, info.stderr
    out = strata("generate", "--model", str(model), "--prompt", "The", env=env)
    assert out.returncode == 0, out.stderr
    tokens_of = strata("generate", "--model", str(model), "--prompt", "The", "--max-tokens", "2",
                       "--temperature", "0")
    assert out.stdout == tokens_of.stdout  # the file's max_tokens and temperature were used


def test_settings_file_errors_name_the_file(strata, tmp_path: Path) -> None:
    config = tmp_path / "strata.toml"
    config.write_text("max_tokns = 2\n")
    one_line_error(strata("plugins", env={"STRATA_CONFIG": str(config)}), str(config), "max_tokns")
    config.write_text("max_tokens = \n")
    one_line_error(strata("plugins", env={"STRATA_CONFIG": str(config)}), str(config))


def test_invalid_values_are_one_line(strata, model: Path) -> None:
    one_line_error(strata("generate", "--model", str(model), "--expert-cache", "-3"), "--expert-cache", "greater than or equal to 0")
    one_line_error(strata(), "a command is needed", "make-synthetic")


def test_serve_checks_step_tokens_before_it_binds(strata) -> None:
    one_line_error(strata("serve", "--step-tokens", "0"), "--step-tokens", "greater than 0")
    one_line_error(strata("serve", "--parallel", "8", "--step-tokens", "4"), "--step-tokens 4 is less than --parallel 8")


def test_version_and_short_flags(strata, model: Path) -> None:
    version = strata("--version")
    assert version.returncode == 0 and version.stdout.startswith("strata ")
    short = strata("generate", "-m", str(model), "-p", "The engine", "-n", "4", "-c", "32", "--temperature", "0")
    long = strata("generate", "--model", str(model), "--prompt", "The engine", "--max-tokens", "4",
                  "--ctx-size", "32", "--temperature", "0")
    assert short.returncode == 0, short.stderr
    assert short.stdout == long.stdout and short.stdout.startswith("The engine")


def test_generate_says_it_stopped_at_the_context_end(strata, model: Path) -> None:
    full = strata("generate", "-m", str(model), "-p", "The engine", "-n", "100", "-c", "16", "--temperature", "0")
    assert full.returncode == 0, full.stderr
    assert "stopped at the end of the context (16 tokens)" in full.stderr
    short = strata("generate", "-m", str(model), "-p", "The engine", "-n", "2", "-c", "16", "--temperature", "0")
    assert "stopped at the end of the context" not in short.stderr


def test_serve_errors_are_one_line(strata, tmp_path: Path) -> None:

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(20))
    one_line_error(strata("serve", "--model", str(broken), "--port", "0"), str(broken))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        one_line_error(strata("serve", "--port", port), "cannot listen", port)


def test_two_servers_starting_at_once_on_one_port_the_loser_is_one_line(strata, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: both servers bind the port (SO_REUSEADDR allows it while neither listens), the
    other one listens first; this one must still get the one-line error and exit 2."""
    import strata_core.cli.serve as serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    winner = socket.socket()
    winner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    class Racing(socket.socket):
        def bind(self, address) -> None:  # type: ignore[no-untyped-def, override]
            super().bind(address)
            winner.bind(address)  # the other server binds too, then listens before this one does
            winner.listen()

    monkeypatch.setattr(serve.socket, "socket", Racing)
    try:
        result = strata("serve", "--port", str(port))
    finally:
        winner.close()
    assert "in use" in one_line_error(result, "cannot listen", str(port))


def test_info_shows_the_parts_of_a_split_model(strata, model: Path, tmp_path: Path) -> None:
    parts = split_copy(model, tmp_path / "tiny.gguf", max_tensors=12)
    out = strata("info", str(parts[0]), "--max-context", "100000")
    assert out.returncode == 0, out.stderr
    assert f"split in {len(parts)} parts: {', '.join(p.name for p in parts)}" in out.stdout
    assert "context: 512 tokens used (--max-context 100000; the model's is 512)" in out.stdout


def test_generate_without_a_tokenizer_is_one_line(strata, tmp_path: Path) -> None:
    from strata_core.gguf.tiny import tiny_hf_model
    from strata_core.gguf.writer import write_gguf

    path = tmp_path / "no-tokenizer.gguf"
    write_gguf(tiny_hf_model("qwen3moe", seed=1), path)
    one_line_error(strata("generate", "-m", str(path)), str(path), "no tokenizer")


def test_gate_errors_are_one_line(strata, model: Path) -> None:
    one_line_error(strata("gate", "-m", str(model), "--strategies", "single,bogus"),
                   "unknown strategy 'bogus'", "installed strategies")
    one_line_error(strata("gate", "-m", str(model), "--experts", "9999"), "--experts 9999 is more than the model has")
