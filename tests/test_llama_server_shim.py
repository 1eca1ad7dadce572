"""tools/llama_server_shim.py: llama-server's flags as strata serve options, and the served copy of the
model with the context and chat template the flags ask for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from strata_core.gguf.reader import GGUFFile

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "strata_core" / "data" / "demo-qwen3moe-q8_0.gguf"
_spec = importlib.util.spec_from_file_location("llama_server_shim", REPO / "tools" / "llama_server_shim.py")
shim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shim)


def test_flags_map_to_strata_serve_options(capsys: pytest.CaptureFixture[str]) -> None:
    options, n_ctx, template = shim.translate([
        "--port", "8080", "--temp", "0.8", "--seed", "42", "-s", "-1", "--host", "127.0.0.1", "--offline",
        "--hf-repo", "ggml-org/models", "--hf-file", "x.gguf", "--ctx-size=2048", "-np", "2", "--n-predict", "-1",
        "--alias", "tiny", "--jinja", "--chat-template-file", "t.jinja", "--api-key", "k", "--no-ui",
        "--cors-origins", "http://a", "--pooling", "last", "--metrics"])
    assert options == ["--shutdown-grace", shim.SHUTDOWN_GRACE_S, "--port", "8080", "--seed", "42",
                       "--host", "127.0.0.1",
                       "--kv-pool-tokens", "2048", "--parallel", "2", "--n-predict", "-1", "--model-alias", "tiny",
                       "--api-key", "k", "--no-webui", "--cors", "http://a", "--max-context", "1024"]
    assert (n_ctx, template) == (1024, "t.jinja")  # llama-server's --ctx-size is shared by the slots
    logged = capsys.readouterr().err
    for ignored in ("--temp 0.8", "--offline", "--jinja", "--pooling last", "--metrics"):
        assert f"ignoring {ignored}\n" in logged


def test_a_unified_kv_cache_gives_each_slot_the_whole_context() -> None:
    options, n_ctx, _ = shim.translate(["--ctx-size", "256", "--parallel", "4", "--kv-unified"])
    assert n_ctx == 256 and options[-4:] == ["--parallel", "4", "--max-context", "256"]
    assert options[options.index("--kv-pool-tokens") + 1] == "256"


def test_the_served_copy_has_the_context_and_template_asked_for(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_SHIM_CACHE", str(tmp_path))
    assert shim.served_model(DEMO, 512, None) == DEMO  # within the model's context: the file itself
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    served = shim.served_model(DEMO, 4096, str(template))
    assert served.parent == tmp_path and shim.served_model(DEMO, 4096, str(template)) == served  # cached
    metadata, original = GGUFFile.open(served).metadata, GGUFFile.open(DEMO).metadata
    assert metadata["qwen3moe.context_length"] == 4096
    assert metadata["tokenizer.chat_template"] == "{{ messages[0]['content'] }}"
    assert metadata["tokenizer.ggml.tokens"] == original["tokenizer.ggml.tokens"]
