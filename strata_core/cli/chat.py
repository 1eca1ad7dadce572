"""``strata chat``: a conversation with the model on the terminal, turns rendered by its chat template."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pydantic import Field

from strata_core.cli.generate import SamplingCommand, generate, quiet_logs
from strata_core.errors import RequestError
from strata_core.serving.requests import GenerationRequest
from strata_core.text.harmony import HarmonyParser, uses_harmony

PROMPT = "> "
COMMANDS = "/exit (or Ctrl-D) quits, /reset forgets the conversation"


class ChatCommand(SamplingCommand):
    """Chat with the model: each line you type is a user turn, the reply streams back (/exit quits)."""

    max_tokens: int = Field(512, ge=1, description="tokens of one reply at most")

    def cli_cmd(self) -> None:
        """Load the engine, then read turns until /exit or the end of input."""
        engine = self.load_engine()
        try:
            print(f"strata chat: {COMMANDS}", file=sys.stderr)
            _converse(engine, self)
        finally:
            engine.close()


def _converse(engine: Any, command: SamplingCommand) -> None:
    """The read-reply loop: the history grows by each user line and the reply to it."""
    import readline  # noqa: F401  (input() then edits lines and recalls earlier ones)

    harmony = uses_harmony(engine.chat.source)
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        request = GenerationRequest(engine.tokenizer.encode(engine.chat.render(history)),
                                    command.sampling_params(), keep_special_tokens=harmony)
        try:
            with quiet_logs():
                end, reply = asyncio.run(generate(engine, request, HarmonyParser() if harmony else None))
        except RequestError as error:  # the conversation outgrew the context
            history.pop()
            print(f"strata: {error} (/reset starts a new conversation)", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": reply})
        if end.reason == "length" and end.prompt_tokens + end.completion_tokens > engine.max_context:
            print(f"strata: the context is full ({engine.max_context} tokens); /reset starts a new conversation",
                  file=sys.stderr)
