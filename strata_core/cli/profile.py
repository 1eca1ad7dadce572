"""``strata profile``: record how often each (layer, expert) is routed to over a prompt file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import Field

from strata_core.cli.settings import ENGINE, settings_with
from strata_core.errors import ConfigError

log = logging.getLogger(__name__)


def read_prompts(path: Path) -> list[str]:
    """Prompts of ``path``: one per non-empty line; in a ``.jsonl`` file each line is a JSON string
    or an object with a "prompt" or "text" field."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise ConfigError(f"--prompts {path}: cannot read ({e})") from e
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for n, line in enumerate(lines, 1):
        item = json.loads(line)
        text = item if isinstance(item, str) else item.get("prompt", item.get("text"))
        if not isinstance(text, str):
            raise ConfigError(f"--prompts {path}:{n}: expected a string or an object with 'prompt'/'text'")
        prompts.append(text)
    return prompts


class ProfileCommand(settings_with(ENGINE)):
    """Run prompts through the model and write a JSON expert-usage profile (for --expert-profile)."""

    prompts: Path = Field(..., description="prompt file: one prompt per line, or .jsonl")
    out: Path | None = Field(None, description="profile to write (default: MODEL.profile.json)")
    decode_tokens: int = Field(0, ge=0, description="also generate this many greedy tokens per prompt")

    def cli_cmd(self) -> None:
        """Prefill (and optionally decode) every prompt, then save the routing counts."""
        from strata_core.engine import Engine

        prompts = read_prompts(self.prompts)
        if not prompts:
            raise ConfigError(f"--prompts {self.prompts}: no prompts")
        engine = Engine.from_settings(self.strata_settings())
        try:
            for prompt in prompts:
                engine.generate(prompt, max_tokens=max(self.decode_tokens, 1), temperature=0.0)
            profile = engine.experts.usage_profile(self.model.name)
        finally:
            engine.close()
        out = self.out or self.model.with_suffix(".profile.json")
        profile.save(out)
        used = len(profile.rank(only_used=True))
        print(f"profile of {len(prompts)} prompts ({profile.tokens} routed tokens): {used} of "
              f"{profile.counts.numel()} experts routed -> {out}")
