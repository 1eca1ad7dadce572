"""``strata generate``: complete a prompt with the model."""

from __future__ import annotations

import sys

from pydantic import Field

from strata_core.config import StrataSettings
from strata_core.sampling import SamplingParams


class GenerateCommand(StrataSettings):
    """Generate text after a prompt (streamed to stdout)."""

    prompt: str = Field("Once upon a time", description="the prompt")
    max_tokens: int = Field(64, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.8, ge=0, description="0 = greedy")
    top_k: int = Field(40, ge=0, description="keep the k most likely tokens (0 = off)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    min_p: float = Field(0.05, ge=0, le=1, description="drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0, description="penalty for repeated tokens (1 = off)")
    seed: int | None = Field(None, description="sampling seed")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")

    def cli_cmd(self) -> None:
        """Load the engine and stream the completion."""
        from strata_core.engine import Engine

        engine = Engine.from_settings(self)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                                top_p=self.top_p, min_p=self.min_p,
                                repetition_penalty=self.repetition_penalty, seed=self.seed)
        prompt = self.prompt
        if self.chat:
            prompt = engine.chat.render([{"role": "user", "content": prompt}])
        sys.stdout.write(self.prompt if not self.chat else "")
        for piece in engine.stream(prompt, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        engine.close()
