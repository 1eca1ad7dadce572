"""Turn API requests into scheduler requests: model name, prompt tokens, sampling, limits."""

from __future__ import annotations

import time
from typing import Any

from strata_core.config import StrataSettings
from strata_core.errors import RequestError
from strata_core.sampling import SamplingParams
from strata_core.requests import GenerationRequest
from strata_core.scheduler import RequestHandle, Scheduler
from strata_core.server.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["GenerationService", "InvalidParamError", "UnknownModelError"]


class InvalidParamError(RequestError):
    """A request parameter is invalid; ``param`` names it."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class UnknownModelError(RequestError):
    """The request names a model this server does not serve (HTTP 404)."""


class GenerationService:
    """The engine and scheduler behind the API, and the name the model is served under."""

    def __init__(self, engine: Any, scheduler: Scheduler, settings: StrataSettings) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.settings = settings
        self.model_id = settings.model_alias or settings.model.stem
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        """Raise UnknownModelError unless ``name`` is the served model (its alias, stem or file name)."""
        if name not in {self.model_id, self.settings.model.stem, self.settings.model.name}:
            raise UnknownModelError(f"the model {name!r} does not exist; this server serves {self.model_id!r}")

    def chat(self, body: ChatCompletionRequest) -> RequestHandle:
        """Submit a chat completion: the messages rendered by the model's chat template."""
        self.check_model(body.model)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
        prompt = self.engine.tokenizer.encode(self.engine.chat.render(messages, add_generation_prompt=True))
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise InvalidParamError("top_logprobs needs logprobs set to true", "top_logprobs")
        return self._submit(body, prompt, body.max_completion_tokens or body.max_tokens, k)

    def complete(self, body: CompletionRequest) -> RequestHandle:
        """Submit a text completion of a string or of token ids."""
        self.check_model(body.model)
        text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        if isinstance(text, str):
            if not isinstance(body.prompt, str) and len(body.prompt) > 1:
                raise InvalidParamError("prompt must be one string or a list of token ids (batches are not supported)", "prompt")
            prompt = self.engine.tokenizer.encode(text)
        else:
            prompt = body.prompt  # token ids
            vocab = self.engine.spec.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise InvalidParamError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return self._submit(body, prompt, body.max_tokens, body.logprobs)

    def _submit(self, body: Any, prompt: list[int], max_tokens: int | None, logprobs: int | None) -> RequestHandle:
        limit = self.scheduler.max_context
        if max_tokens is not None and max_tokens > limit:
            raise InvalidParamError(f"max_tokens is {max_tokens} but the context holds {limit} tokens", "max_tokens")
        params = SamplingParams(
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty, seed=body.seed, max_tokens=max_tokens, stop=body.stops(),
            logprobs=logprobs,
        )  # fmt: skip
        return self.scheduler.submit(GenerationRequest(prompt, params))
