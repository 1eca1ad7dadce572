"""The `strata` command end to end: info, generate, plugins, and errors without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def strata(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_core", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(expert_type="Q8_0")


def test_info_reports_architecture_sizes_and_fit(model):
    result = strata("info", str(model), "--vram-gib", "0.0001,1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "architecture: qwen3moe" in out
    assert "experts: 8 per layer in 2 of 2 layers, top-2" in out
    assert "ffn_up_exps" in out and "Q8_0" in out
    assert "does not fit" in out and "dense + 16 of 16 experts" in out
    assert "dequantized to bf16" in out


def test_generate_streams_text(model):
    result = strata("generate", "--model", str(model), "--prompt", "The engine", "--max-tokens", "8",
                    "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The engine") and len(result.stdout.strip()) > len("The engine")


def test_generate_reads_its_prompt_from_a_file_or_stdin(model, tmp_path):
    """``-f FILE`` and ``-f -`` (stdin) give the text ``--prompt`` gives; a missing file is one line."""
    args = ("generate", "--model", str(model), "-n", "6", "--temperature", "0")
    want = strata(*args, "--prompt", "The engine")
    (tmp_path / "prompt.txt").write_text("The engine")
    from_file = strata(*args, "-f", str(tmp_path / "prompt.txt"))
    piped = subprocess.run([sys.executable, "-m", "strata_core", *args, "-f", "-"], input="The engine",
                           capture_output=True, text=True, timeout=300)
    assert want.returncode == from_file.returncode == piped.returncode == 0, piped.stderr
    assert from_file.stdout == piped.stdout == want.stdout and want.stdout.startswith("The engine")
    missing = strata(*args, "-f", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and f"--file {tmp_path / 'nope.txt'}: No such file" in missing.stderr


def test_plugins_lists_single_with_origin():
    result = strata("plugins")
    assert result.returncode == 0, result.stderr
    assert "single" in result.stdout and "strata (builtin)" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("info", "/nonexistent/model.gguf"), "/nonexistent/model.gguf"),
        (("generate", "--strategy", "nope"), "unknown strategy 'nope'"),
        (("generate", "--devices", "cuda:7"), "cuda:7 does not exist"),
        (("make-synthetic", "--preset", "tiny", "/nonexistent/dir/x.gguf"),
         "/nonexistent/dir/x.gguf: no directory /nonexistent/dir to write the model in"),
        (("generate", "--strategy-options", "foo=1"),
         "invalid options for strategy 'single': foo: not a known option (its options: none)"),
        (("profile",), "invalid settings: --prompts: required"),
    ],
)
def test_errors_are_one_line_without_traceback(args, message):
    result = strata(*args)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("strata: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.stderr and "pydantic.dev" not in result.stderr


def test_invalid_flag_value_names_the_option(model):
    result = strata("generate", "--model", str(model), "--pcie-frac", "2")
    assert result.returncode != 0
    assert "pcie_frac" in result.stderr or "pcie-frac" in result.stderr
    assert "Traceback" not in result.stderr
