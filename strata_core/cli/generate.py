"""``strata generate``: complete a prompt with the model; what ``strata chat`` shares with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import Field

from strata_core.cli.settings import ENGINE, settings_with
from strata_core.errors import ConfigError
from strata_core.text.harmony import HarmonyParser, Piece, uses_harmony
from strata_core.serving.requests import Finished, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler


class SamplingCommand(settings_with(ENGINE)):  # type: ignore[misc]
    """Base of the commands that load the engine and sample text from it (generate, chat)."""

    max_tokens: int = Field(64, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.8, ge=0, description="0 = greedy")
    top_k: int = Field(40, ge=0, description="keep the k most likely tokens (0 = off)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    min_p: float = Field(0.05, ge=0, le=1, description="drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0, description="penalty for repeated tokens (1 = off)")
    seed: int | None = Field(None, description="sampling seed")

    def sampling_params(self) -> SamplingParams:
        """The sampling flags as the scheduler takes them."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              seed=self.seed)

    def load_engine(self) -> Any:
        """The engine of these settings, with a progress bar on stderr (a terminal's); a ConfigError
        when the model has no tokenizer."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        from strata_core.engine import Engine

        # disable=None: no bar where stderr is not a terminal; log lines go above the bar
        with tqdm(total=100, desc="loading", unit="%", file=sys.stderr, disable=None,
                  bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") as bar, logging_redirect_tqdm():
            engine = Engine.from_settings(self.strata_settings(),
                                          progress=lambda fraction: bar.update(100 * fraction - bar.n))
        if engine.tokenizer is None:
            engine.close()
            raise ConfigError(f"{self.model} has no tokenizer: it cannot generate text")
        return engine


class GenerateCommand(SamplingCommand):
    """Generate text after a prompt (streamed to stdout)."""

    prompt: str = Field("Once upon a time", description="the prompt")
    file: str | None = Field(None, description="read the prompt from this file instead (- reads stdin)")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template (a harmony reply's "
                                          "reasoning goes to stderr, its answer to stdout)")

    def cli_cmd(self) -> None:
        """Load the engine and stream the completion; say so on stderr when the context filled up."""
        text = self._prompt()  # before the load: a missing file is said at once
        engine = self.load_engine()
        try:
            prompt = engine.chat.render([{"role": "user", "content": text}]) if self.chat else text
            sys.stdout.write("" if self.chat else text)
            harmony = self.chat and uses_harmony(engine.chat.source)
            request = GenerationRequest(engine.tokenizer.encode(prompt), self.sampling_params(),
                                        keep_special_tokens=harmony)
            with quiet_logs():
                end, _ = asyncio.run(generate(engine, request, HarmonyParser() if harmony else None))
            sys.stdout.write("\n")
        finally:
            engine.close()
        if end.reason == "length" and end.prompt_tokens + end.completion_tokens > engine.max_context:
            print(f"strata: stopped at the end of the context ({engine.max_context} tokens); "
                  "a larger --max-context (-c) lets it go on", file=sys.stderr)

    def _prompt(self) -> str:
        """The prompt: ``--file``'s text (stdin for ``-``), else ``--prompt``."""
        if self.file is None:
            return self.prompt
        if self.file == "-":
            return sys.stdin.read()
        try:
            with open(self.file, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"--file {self.file}: {getattr(error, 'strerror', None) or error}") from None


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """While text streams to a terminal, only warnings are logged (on stderr), not INFO lines between
    the tokens."""
    root = logging.getLogger()
    level = root.level
    if sys.stdout.isatty():
        root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


async def generate(engine: Any, request: GenerationRequest,
                   harmony: HarmonyParser | None = None) -> tuple[Finished, str]:
    """Run ``request`` through a one-slot scheduler (the server's path), writing text as it comes;
    with ``harmony`` the reply's reasoning goes to stderr and its content to stdout. The end of the
    generation and the text written to stdout."""
    scheduler = Scheduler(engine, parallel=1, max_queue=0, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=engine.settings.step_tokens, overlap=engine.settings.overlap_windows)
    content: list[str] = []
    scheduler.start()
    try:
        async for event in scheduler.submit(request):
            if isinstance(event, Finished):
                content += _write(harmony.finish() if harmony else [])
                return event, "".join(content)
            content += _write(harmony.feed(event.text) if harmony else [Piece("content", event.text)])
    finally:
        scheduler.stop()
    raise RuntimeError("the generation ended without a Finished event")


def _write(pieces: list[Piece]) -> list[str]:
    """Write reasoning to stderr and content to stdout; the content's texts."""
    for piece in pieces:
        out = sys.stderr if piece.kind == "reasoning" else sys.stdout
        out.write(piece.text)
        out.flush()
    return [piece.text for piece in pieces if piece.kind != "reasoning"]
