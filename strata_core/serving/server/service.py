"""Turn API requests into scheduler requests: model name, prompt tokens, sampling, limits.

Rendering the chat template and tokenizing run on a worker thread, never on the event loop: a
long prompt must not stall ``/health`` or the other streams. The template itself renders in a child
process bounded in time and output (template_process.py); a text that cannot fit the context is
refused before it is tokenized.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import anyio
import msgspec

from strata_core.config import StrataSettings
from strata_core.errors import InvalidParamError, RequestError
from strata_core.text.chat import ChatTemplate
from strata_core.text.harmony import uses_harmony
from strata_core.text.template_process import TemplateProcesses
from strata_core.text.tokenizer import token_bytes
from strata_core.serving.grammar import Grammars, TokenConstraint, server_grammar
from strata_core.serving.requests import ContextLengthError, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import RequestHandle, Scheduler
from strata_core.serving.server.constraints import request_grammar
from strata_core.serving.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from strata_core.serving.generic_calls import generic_messages
from strata_core.serving.think import opens_reasoning, thinks
from strata_core.serving.tool_calls import ReplyFormat, tool_call_format

__all__ = ["GenerationService", "InvalidParamError", "UnknownModelError"]

log = logging.getLogger(__name__)

# names already logged, so each is logged once: unknown request fields, and model names served by the one model
_FIELDS_LOGGED: set[str] = set()
_MODELS_LOGGED: set[str] = set()
_MAX_LOGGED = 1024  # names remembered of each kind; past it new ones go unlogged, so no client grows the sets
_MAX_NAME_CHARS = 64  # of a name in the log


def _log_new(logged: set[str], names: Iterable[str], prefix: str) -> None:
    """Log ``prefix`` and those of ``names`` (cut to ``_MAX_NAME_CHARS``) not yet in ``logged`` in one INFO
    line, and add them to it."""
    new = [name for name in dict.fromkeys(n[:_MAX_NAME_CHARS] for n in names) if name not in logged]
    if new and len(logged) < _MAX_LOGGED:
        logged.update(new)
        log.info("%s%s", prefix, ", ".join(new))


class UnknownModelError(RequestError):
    """The request names a model this server does not serve (HTTP 404)."""


def _check_supported(body: Any) -> None:
    """400 naming the field for what Strata does not implement and cannot silently leave out."""
    if body.n > 1:
        raise InvalidParamError("n > 1 is not supported: send one request per choice", "n", "unsupported_value")
    if body.functions:
        raise InvalidParamError("functions (the legacy function calling) is not supported: send tools", "functions",
                                "unsupported_value")
    if body.function_call not in (None, "none", "auto"):
        raise InvalidParamError("function_call (the legacy function calling) is not supported: send tool_choice",
                                "function_call", "unsupported_value")
    if isinstance(body, CompletionRequest):
        for name in ("tools", "tool_choice"):
            if getattr(body, name) not in (None, "none", "auto"):
                raise InvalidParamError(f"{name} is for chat completions", name, "unsupported_value")
        if body.echo:
            raise InvalidParamError("echo is not supported", "echo", "unsupported_value")
        if body.suffix:
            raise InvalidParamError("suffix is not supported", "suffix", "unsupported_value")
        if body.best_of not in (None, 1):
            raise InvalidParamError("best_of > 1 is not supported", "best_of", "unsupported_value")


def min_tokens(tokenizer: Any, text: str) -> int:
    """The tokenizer's lower bound on the tokens of ``text`` (0 for one that has none)."""
    bound = getattr(tokenizer, "min_tokens", None)
    return bound(text) if bound is not None else 0


def _reasoning(text: str | None, harmony: bool) -> dict[str, str]:
    """An earlier reply's reasoning for the chat template: ``reasoning_content``, and for harmony also
    ``thinking`` (what gpt-oss's template reads; llama.cpp copies it the same way)."""
    if not text:
        return {}
    return {"reasoning_content": text, "thinking": text} if harmony else {"reasoning_content": text}


def _arguments(text: str) -> Any:
    """A tool call's arguments for the chat template: the JSON object parsed (templates read a mapping,
    as transformers passes it), else the text as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _template_message(message: ChatMessage, harmony: bool) -> dict[str, Any]:
    """A message as the chat template reads it (keys it does not have are left out: templates test
    ``"tool_calls" in message``)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text(),
                           **_reasoning(message.reasoning_content, harmony)}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": call.type,
                              "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _offered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools offered, as transformers passes them to a chat template (None: none offered);
    InvalidParamError for a tool_choice the tools cannot meet."""
    choice, names = body.tool_choice, [tool.function.name for tool in body.tools or []]
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
        raise InvalidParamError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidParamError(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
    if not names or choice == "none":
        return None
    return [msgspec.to_builtins(tool) for tool in body.tools or []]


def _continuation(body: ChatCompletionRequest) -> tuple[bool, str | None]:
    """Whether the prompt ends with the assistant's header (``add_generation_prompt``), and the content
    the rendered text is cut after (``continue_final_message``: the final message, an assistant's, is
    continued rather than closed, as transformers and vLLM do it); InvalidParamError for both at once,
    and for a conversation ending with two assistant messages (as llama-server refuses it: which one
    would the reply follow?)."""
    if len(body.messages) >= 2 and body.messages[-1].role == body.messages[-2].role == "assistant":
        raise InvalidParamError("the conversation ends with two assistant messages; send one (its reply to "
                                "continue, with continue_final_message) or end with the user's", "messages")
    if not body.continue_final_message:
        return body.add_generation_prompt, None
    if body.add_generation_prompt:
        raise InvalidParamError("continue_final_message and add_generation_prompt cannot both be true (send "
                                "add_generation_prompt: false)", "continue_final_message")
    if body.messages[-1].role != "assistant":
        raise InvalidParamError("continue_final_message needs the final message to be the assistant's",
                                "continue_final_message")
    return False, body.messages[-1].text() or None


def _template_args(effort: str | None) -> dict[str, Any]:
    """The chat template's variables for OpenAI's ``reasoning_effort``, as llama-server maps it:
    ``reasoning_effort`` (gpt-oss's template reads it), or ``enable_thinking`` false for "none"."""
    if effort is None:
        return {}
    return {"enable_thinking": False} if effort == "none" else {"reasoning_effort": effort}


class GenerationService:
    """The engine and scheduler behind the API, and the name the model is served under."""

    def __init__(self, engine: Any, scheduler: Scheduler, settings: StrataSettings) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.settings = settings
        self.model_id = settings.model_alias or settings.model.stem
        self.created = int(time.time())
        self.grammars = Grammars(engine.tokenizer, engine.spec.vocab_size)
        self.default_grammar = server_grammar(settings.grammar_file, settings.json_schema)
        # A ChatTemplate (jinja2) renders in killable child processes, bounded in time and size.
        chat = engine.chat
        self.templates: TemplateProcesses | None = None
        if isinstance(chat, ChatTemplate):
            max_chars = int(settings.template_max_mib * 2**20)
            self.templates = TemplateProcesses(
                chat.source, chat.bos_token, chat.eos_token, timeout=settings.template_timeout, max_chars=max_chars,
                memory_bytes=2**30 + 8 * max_chars, name=f"the chat template of {settings.model.name}")

    def close(self) -> None:
        """Stop the template processes."""
        if self.templates is not None:
            self.templates.close()

    def check_model(self, name: str | None) -> None:
        """Accept ``name`` (or none) for the served model, logging each other name once; with
        ``strict_model`` raise UnknownModelError unless it is the model's alias, stem or file name."""
        if name is None or name in {self.model_id, self.settings.model.stem, self.settings.model.name}:
            return
        if self.settings.strict_model:
            raise UnknownModelError(f"the model {name!r} does not exist; this server serves {self.model_id!r}")
        _log_new(_MODELS_LOGGED, [name], f"serving {self.model_id} for requests naming ")

    def check_fields(self, unknown: list[str]) -> None:
        """Accept the ``unknown`` fields of a request, logging each name once; with ``strict_requests``
        an InvalidParamError (400) naming them."""
        if not unknown:
            return
        if self.settings.strict_requests:
            raise InvalidParamError("invalid request: " + "; ".join(f"unknown field `{name}`" for name in unknown),
                                    unknown[0], "invalid_request")
        _log_new(_FIELDS_LOGGED, unknown, "ignoring unknown request fields: ")

    @property
    def default_max_tokens(self) -> int | None:
        """``n_predict``, the max_tokens of a request that sets none (None: until the context is full)."""
        return min(self.settings.n_predict, self.scheduler.max_context) if self.settings.n_predict > 0 else None

    def _thinking(self) -> dict[str, bool]:
        """``enable_thinking`` for a template that reads it, as llama-server always passes it (true unless
        ``--reasoning off``): templates test ``not enable_thinking``, which an unset one passes."""
        if "enable_thinking" not in self.engine.chat.source:
            return {}
        return {"enable_thinking": self.settings.reasoning != "off"}

    def seed(self, asked: int | None) -> int | None:
        """The sampling seed of a request that asks for ``asked``: the server's ``--seed`` when it sets
        none (None: a fresh random one)."""
        return asked if asked is not None else self.settings.seed

    @property
    def harmony(self) -> bool:
        """Whether replies are harmony (gpt-oss's chat template): their text keeps the channel markers
        and the chat responses split it into reasoning_content and content."""
        return uses_harmony(self.engine.chat.source)

    def reply_format(self, body: ChatCompletionRequest, handle: RequestHandle) -> ReplyFormat:
        """How the chat reply of ``handle`` to ``body`` is read: harmony channels, tool calls when tools
        are offered (only the first with ``parallel_tool_calls`` false), ``<think>`` reasoning where the
        template has it."""
        offered = bool(body.tools) and body.tool_choice != "none"
        return ReplyFormat(self.harmony, tool_call_format(self.engine.chat.source) if offered else None,
                           1 if body.parallel_tool_calls is False else None, self._think(handle.opens_in_reasoning))

    def _think(self, opened: bool) -> str | None:
        """``ReplyFormat.think`` of a reply: "open" when its prompt opened a ``<think>`` block, "tags" when
        the template reasons in them, else None."""
        if self.harmony or not thinks(self.engine.chat.source):
            return None
        return "open" if opened else "tags"

    def _check_size(self, text: str, param: str) -> None:
        """ContextLengthError, before any tokenizing, for a text with more tokens than the context holds
        (at least one token per ``max_token_chars`` characters): the tokenizer holds the GIL for the
        whole encode, so a huge text would freeze every other request meanwhile."""
        at_least = min_tokens(self.engine.tokenizer, text)
        if at_least > self.scheduler.max_context:
            raise ContextLengthError(f"{param} has {len(text)} characters, at least {at_least} tokens, more than the "
                                     f"context holds ({self.scheduler.max_context}); it was not tokenized", at_least,
                                     self.scheduler.max_context)

    async def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "content") -> list[int]:
        """Token ids of ``text``, computed on a worker thread (a text longer than the context can hold
        is refused first)."""
        self._check_size(text, param)
        return await anyio.to_thread.run_sync(self.engine.tokenizer.encode, text, add_special_tokens)

    async def pieces(self, tokens: list[int]) -> list[str | list[int]]:
        """Each of ``tokens``' own piece, as llama-server gives it: its text where its bytes are whole
        UTF-8 (special tokens included), else the list of its byte values (a token holding part of a
        character); on a worker thread."""

        def run() -> list[str | list[int]]:
            out: list[str | list[int]] = []
            for piece in token_bytes(self.engine.tokenizer.backend, tokens):
                try:
                    out.append(piece.decode())
                except UnicodeDecodeError:
                    out.append(list(piece))
            return out

        return await anyio.to_thread.run_sync(run)

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (ids checked against the vocabulary), on a worker thread."""
        self._check_ids(tokens, "tokens")
        return await anyio.to_thread.run_sync(self.engine.tokenizer.decode, tokens)

    async def constraint(self, body: Any, opened: bool = False) -> TokenConstraint | None:
        """The grammar ``body``'s output must follow (its own, or the server's), compiled for this request
        on a worker thread; None for free text (``opened``: the prompt opened a ``<think>`` block, which a
        forced tool call may finish first). InvalidParamError for one that is not valid."""
        grammar = request_grammar(body, tool_call_format(self.engine.chat.source), self.default_grammar,
                                  self._think(opened))
        if grammar is None:
            return None
        return await anyio.to_thread.run_sync(self.grammars.compile, *grammar)

    async def render(self, body: ChatCompletionRequest) -> str:
        """The prompt text of a chat request: its messages through the model's chat template, on a worker
        thread (the render is stopped if the request goes away)."""
        limit = self.scheduler.max_context
        if len(body.messages) > limit:  # each message renders to a token at least
            raise ContextLengthError(f"the request has {len(body.messages)} messages, more than the context holds "
                                     f"tokens ({limit})", len(body.messages), limit)
        self._check_size("".join(m.text() for m in body.messages), "messages")
        generation_prompt, final = _continuation(body)
        messages = [_template_message(m, self.harmony) for m in body.messages]
        template_args = {**self._thinking(), **(body.chat_template_kwargs or {}),
                         **_template_args(body.reasoning_effort)}
        tools = _offered_tools(body)
        if tool_call_format(self.engine.chat.source) == "json":  # the template knows no tools: described here
            messages = generic_messages(messages, tools, body.parallel_tool_calls is not False)
        elif tools is not None:
            template_args["tools"] = tools

        cancelled = threading.Event()

        def render() -> str:
            if self.templates is not None:
                text = self.templates.render(messages, generation_prompt, cancelled=cancelled, **template_args)
            else:
                text = self.engine.chat.render(messages, add_generation_prompt=generation_prompt, **template_args)
            if final:  # continued: the text ends where the final message's content does
                text = text[: text.rindex(final) + len(final)] if final in text else text
            self._check_size(text, "the rendered conversation")
            return text

        try:
            return await anyio.to_thread.run_sync(render, abandon_on_cancel=True)
        except BaseException:
            cancelled.set()  # the request went away: its template render is stopped
            raise

    async def chat(self, body: ChatCompletionRequest) -> RequestHandle:
        """Submit a chat completion: the messages rendered by the model's chat template."""
        self.check_model(body.model)
        _check_supported(body)
        if body.top_logprobs and not body.logprobs:
            raise InvalidParamError("top_logprobs needs logprobs set to true", "top_logprobs")
        text = await self.render(body)
        opened = opens_reasoning(text)
        constraint = await self.constraint(body, opened)
        prompt = await anyio.to_thread.run_sync(self.engine.tokenizer.encode, text, abandon_on_cancel=True)
        k = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens or body.n_predict or self.default_max_tokens
        handle = self._submit(body, prompt, max_tokens, k, constraint, keep_special_tokens=self.harmony)
        handle.opens_in_reasoning = opened
        return handle

    async def complete(self, body: CompletionRequest, fallback_max_tokens: int | None = 16) -> RequestHandle:
        """Submit a text completion of a string or of token ids; ``fallback_max_tokens`` limits one that
        sets no limit when the server's n_predict does not either (16: OpenAI's default; None: until the
        context is full)."""
        self.check_model(body.model)
        _check_supported(body)
        constraint = await self.constraint(body)
        text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        if isinstance(text, str):
            if not isinstance(body.prompt, str) and len(body.prompt) > 1:
                raise InvalidParamError("prompt must be one string or a list of token ids (batches are not supported)", "prompt")
            prompt = await self.tokenize(text, param="prompt")
        else:
            prompt = body.prompt  # token ids
            self._check_ids(prompt, "prompt")
        max_tokens = body.max_tokens or body.n_predict or self.default_max_tokens or fallback_max_tokens
        return self._submit(body, prompt, max_tokens, body.logprobs, constraint)

    async def llama_logit_bias(self, raw: list[Any] | dict[str, Any] | None) -> dict[str, float] | None:
        """llama-server's ``logit_bias`` by token id: ``[[token, bias], ...]`` or ``{token: bias}``, a token
        an id or a text (each of its tokens biased), a bias a number (clamped to OpenAI's [-100, 100]) or
        false (banned: -100); entries of other shapes are skipped, as llama-server skips them."""
        if raw is None:
            return None
        pairs = raw.items() if isinstance(raw, dict) else [tuple(p) for p in raw if isinstance(p, list) and len(p) == 2]
        out: dict[str, float] = {}
        for token, value in pairs:
            if value is False or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                bias = -100.0 if value is False else max(-100.0, min(100.0, float(value)))
            else:
                continue
            if isinstance(token, str) and not token.isdigit():
                ids = await self.tokenize(token, add_special_tokens=False, param="logit_bias")
            elif isinstance(token, (int, str)) and not isinstance(token, bool):
                ids = [int(token)]
            else:
                continue
            out.update((str(t), bias) for t in ids if 0 <= t < self.engine.spec.vocab_size)
        return out

    def _check_ids(self, ids: list[Any], param: str) -> None:
        vocab = self.engine.spec.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidParamError(f"{param} token ids must be integers in [0, {vocab})", param)

    def _logit_bias(self, body: Any) -> tuple[tuple[int, float], ...]:
        vocab = self.engine.spec.vocab_size
        out = []
        for key, bias in (body.logit_bias or {}).items():
            if not (key.isdigit() and int(key) < vocab):
                raise InvalidParamError(f"logit_bias keys must be token ids in [0, {vocab}), got {key[:40]!r}",
                                        "logit_bias")
            out.append((int(key), bias))
        return tuple(out)

    def _submit(self, body: Any, prompt: list[int], max_tokens: int | None, logprobs: int | None,
                constraint: TokenConstraint | None, keep_special_tokens: bool = False) -> RequestHandle:
        limit = self.scheduler.max_context
        if max_tokens is not None and max_tokens > limit:
            raise InvalidParamError(f"max_tokens is {max_tokens} but the context holds {limit} tokens", "max_tokens")
        if ignored := body.ignored():
            log.info("ignoring fields Strata does not implement: %s", ", ".join(ignored))
        params = SamplingParams(
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty, seed=self.seed(body.seed), max_tokens=max_tokens, stop=body.stops(),
            logprobs=logprobs, logit_bias=self._logit_bias(body), ignore_eos=body.ignore_eos,
        )  # fmt: skip
        return self.scheduler.submit(GenerationRequest(prompt, params, keep_special_tokens, constraint))
