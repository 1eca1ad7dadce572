#!/usr/bin/env python3
"""Run ``strata serve`` in place of ``llama-server``, so that llama.cpp's server tests can drive it.

llama.cpp's ``tools/server/tests/utils.py`` starts the binary named by ``LLAMA_SERVER_BIN_PATH`` with
llama-server's flags. This shim maps the flags Strata has an answer for onto ``strata serve`` options
and execs it; every other flag is ignored with one log line on stderr. Nothing can be downloaded, so
the model flags (``-m``/``--model``, ``-hf``/``--hf-repo``, ``--hf-file``, ``--model-url``) all mean the
local GGUF named by ``STRATA_SHIM_MODEL``. The served file is a copy of it with two keys changed, the
way llama-server's flags change them there: the context length raised to ``--ctx-size`` (Strata caps
the context at the model's), and the chat template replaced by ``--chat-template-file`` (else by
``STRATA_SHIM_CHAT_TEMPLATE`` when set). Copies are cached under ``STRATA_SHIM_CACHE``
(default: a ``strata-shim`` folder in the temporary directory)::

    LLAMA_SERVER_BIN_PATH=tools/llama_server_shim.py STRATA_SHIM_MODEL=model.gguf pytest unit/
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

# llama-server flag -> strata serve option (each takes a value)
VALUE_FLAGS = {
    "--port": "--port", "--host": "--host", "-c": "--kv-pool-tokens", "--ctx-size": "--kv-pool-tokens",
    "-np": "--parallel", "--parallel": "--parallel", "-n": "--n-predict", "--n-predict": "--n-predict",
    "--alias": "--model-alias", "-a": "--model-alias", "--api-key": "--api-key", "--cors-origins": "--cors",
    "-t": "--threads", "--threads": "--threads", "-s": "--seed", "--seed": "--seed",
    "--reasoning": "--reasoning",
}
MODEL_FLAGS = {"-m", "--model", "-hf", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"}
TEMPLATE_FLAGS = {"--chat-template-file"}
SWITCHES = {"--no-ui": "--no-webui"}
# llama-server switches that take no value (any other unknown flag's value is skipped with it)
BARE_FLAGS = {
    "--offline", "--cont-batching", "--embedding", "--embeddings", "--reranking", "--rerank", "--metrics",
    "--kv-unified", "--swa-full", "--slots", "--no-slots", "--verbose", "-v", "--context-shift", "--no-models-autoload",
    "--jinja", "--no-jinja", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling",
}
SHUTDOWN_GRACE_S = "1"  # the tests stop each server with SIGTERM and kill it 5 s later


def _log(message: str) -> None:
    print(f"llama_server_shim: {message}", file=sys.stderr, flush=True)


def _takes_value(flag: str, following: str | None) -> bool:
    """Whether an unknown flag's next argument is its value (not a flag, or a negative number)."""
    if flag in BARE_FLAGS or following is None:
        return False
    return not following.startswith("-") or following[1:2].isdigit()


def translate(argv: list[str]) -> tuple[list[str], int | None, str | None]:
    """``strata serve`` options for llama-server's ``argv``, with the context of a slot (``--ctx-size``
    over ``--parallel``) and the chat template file asked for (None where not given); unknown flags are
    logged and dropped."""
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
    out, n_ctx, template = ["--shutdown-grace", SHUTDOWN_GRACE_S], None, None
    i = 0
    while i < len(argv):
        flag, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if VALUE_FLAGS.get(flag) == "--seed" and value is not None and int(value) < 0:
            pass  # llama-server's -1: a random seed each request, Strata's default
        elif flag in VALUE_FLAGS and value is not None:
            out += [VALUE_FLAGS[flag], value]
            n_ctx = int(value) if VALUE_FLAGS[flag] == "--kv-pool-tokens" else n_ctx
        elif flag in MODEL_FLAGS or flag in TEMPLATE_FLAGS:
            template = value if flag in TEMPLATE_FLAGS else template
        elif flag in SWITCHES:
            out.append(SWITCHES[flag])
            i += 1
            continue
        elif _takes_value(flag, value):
            _log(f"ignoring {flag} {value}")
        else:
            _log(f"ignoring {flag}")
            i += 1
            continue
        i += 2
    if n_ctx is not None:  # llama-server's --ctx-size is the KV of all slots; each slot gets its share,
        parallel = int(out[out.index("--parallel") + 1]) if "--parallel" in out else 1
        n_ctx = n_ctx if "--kv-unified" in argv else n_ctx // parallel  # or all of it from one shared pool
        out += ["--max-context", str(n_ctx)]
    return out, n_ctx, template


def served_model(model: Path, n_ctx: int | None, template: str | None) -> Path:
    """``model``, or a cached copy of it with its context length raised to ``n_ctx`` and its chat
    template replaced by the text of the file ``template`` (a copy once made is found without
    importing the GGUF modules, so a server starts at once)."""
    text = Path(template).read_text() if template else None
    if n_ctx is None and text is None:
        return model
    stat = model.stat()
    key = repr((str(model.resolve()), stat.st_size, stat.st_mtime_ns, n_ctx, text))
    cache = Path(os.environ.get("STRATA_SHIM_CACHE", Path(tempfile.gettempdir()) / "strata-shim"))
    path = cache / f"{model.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.gguf"
    if path.exists():
        return path
    from strata_core.gguf.reader import GGUFFile
    from strata_core.gguf.writer import requantize_gguf

    metadata = GGUFFile.open(model).metadata
    overrides: dict[str, object] = {}
    context = f"{metadata['general.architecture']}.context_length"
    if n_ctx and context in metadata and n_ctx > metadata[context]:
        overrides[context] = n_ctx
    if text is not None and "tokenizer.chat_template" in metadata:
        overrides["tokenizer.chat_template"] = text
    if not overrides:
        return model
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    requantize_gguf(model, partial, lambda name: None, metadata=overrides)
    partial.replace(path)  # whole or absent, also with servers starting side by side
    return path


def main() -> None:
    """Translate the flags, prepare the model and exec ``strata serve``."""
    if "STRATA_SHIM_MODEL" not in os.environ:
        sys.exit("llama_server_shim: set STRATA_SHIM_MODEL to the GGUF to serve")
    options, n_ctx, template = translate(sys.argv[1:])
    template = template or os.environ.get("STRATA_SHIM_CHAT_TEMPLATE")
    model = served_model(Path(os.environ["STRATA_SHIM_MODEL"]), n_ctx, template)
    strata = os.environ.get("STRATA_SHIM_STRATA") or shutil.which("strata") or str(Path(sys.executable).with_name("strata"))
    args = [strata, "serve", "--model", str(model), *options]
    _log(" ".join(args))
    os.execv(args[0], args)


if __name__ == "__main__":
    main()
