"""``strata generate``: complete a prompt with the model."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pydantic import Field

from strata_core.cli.settings import ENGINE, settings_with
from strata_core.errors import ConfigError
from strata_core.text.harmony import HarmonyParser, Piece, uses_harmony
from strata_core.serving.requests import Finished, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler


class GenerateCommand(settings_with(ENGINE)):  # type: ignore[misc]
    """Generate text after a prompt (streamed to stdout)."""

    prompt: str = Field("Once upon a time", description="the prompt")
    file: str | None = Field(None, description="read the prompt from this file instead (- reads stdin)")
    max_tokens: int = Field(64, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.8, ge=0, description="0 = greedy")
    top_k: int = Field(40, ge=0, description="keep the k most likely tokens (0 = off)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    min_p: float = Field(0.05, ge=0, le=1, description="drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0, description="penalty for repeated tokens (1 = off)")
    seed: int | None = Field(None, description="sampling seed")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template (a harmony reply's "
                                          "reasoning goes to stderr, its answer to stdout)")

    def cli_cmd(self) -> None:
        """Load the engine and stream the completion; say so on stderr when the context filled up."""
        from strata_core.engine import Engine

        text = self._prompt()  # before the load: a missing file is said at once
        engine = Engine.from_settings(self.strata_settings())
        try:
            if engine.tokenizer is None:
                raise ConfigError(f"{self.model} has no tokenizer: it cannot generate text")
            params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                                    top_p=self.top_p, min_p=self.min_p,
                                    repetition_penalty=self.repetition_penalty, seed=self.seed)
            prompt = engine.chat.render([{"role": "user", "content": text}]) if self.chat else text
            sys.stdout.write("" if self.chat else text)
            harmony = self.chat and uses_harmony(engine.chat.source)
            request = GenerationRequest(engine.tokenizer.encode(prompt), params, keep_special_tokens=harmony)
            end = asyncio.run(_generate(engine, request, HarmonyParser() if harmony else None))
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


async def _generate(engine: Any, request: GenerationRequest, harmony: HarmonyParser | None = None) -> Finished:
    """Run ``request`` through a one-slot scheduler (the server's path), writing text as it comes;
    with ``harmony`` the reply's reasoning goes to stderr and its content to stdout."""
    scheduler = Scheduler(engine, parallel=1, max_queue=0, conv_cache=0, conv_cache_bytes=0,
                          step_tokens=engine.settings.step_tokens)
    scheduler.start()
    try:
        async for event in scheduler.submit(request):
            if isinstance(event, Finished):
                _write(harmony.finish() if harmony else [])
                return event
            _write(harmony.feed(event.text) if harmony else [Piece("content", event.text)])
    finally:
        scheduler.stop()
    raise RuntimeError("the generation ended without a Finished event")


def _write(pieces: list[Piece]) -> None:
    for piece in pieces:
        out = sys.stderr if piece.kind == "reasoning" else sys.stdout
        out.write(piece.text)
        out.flush()
