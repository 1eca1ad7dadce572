"""Render chat messages into a prompt with the model's Jinja chat template.

The template is ``tokenizer.chat_template`` from the GGUF, rendered the way transformers'
``apply_chat_template`` does: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text,
and the globals ``raise_exception`` and ``strftime_now``. ``bos_token`` and ``eos_token`` are set
from the GGUF's special tokens; ``date_string`` and ``datetime`` are today's date, as llama.cpp sets
them. A GGUF without a template gets ``CHATML_TEMPLATE``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata_core.errors import ModelFileError, RequestError, TemplateLimitError

__all__ = ["CHATML_TEMPLATE", "ChatTemplate"]

#: The default template (ChatML, as Qwen uses): ``<|im_start|>{role}\n{content}<|im_end|>\n`` per
#: message, then ``<|im_start|>assistant\n`` when a generation prompt is asked for.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (transformers' assistant mask) and render its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


#: the longest string or list one ``*`` / ``**`` of a template may make (and the largest number, in bits)
MAX_PRODUCT = 64 << 20


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with ``*`` and ``**`` checked before they run: ``'a' * 2**34`` is
    an error, not 16 GiB (jinja2 would even fold it while compiling the template)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise jinja2.exceptions.SecurityError(f"the template makes a sequence of {len(seq) * n} items "
                                                          f"(more than {MAX_PRODUCT})")
        elif (isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
              and right * abs(left).bit_length() > MAX_PRODUCT):
            raise jinja2.exceptions.SecurityError(f"the template raises a number to a power of {right} "
                                                  f"bits past the bound")
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelFileError(f"the chat template does not compile: {exc.message} (template line {exc.lineno})") from exc

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> ChatTemplate:
        """The GGUF's ``tokenizer.chat_template``, or ``CHATML_TEMPLATE`` when it has none."""
        source = metadata.get("tokenizer.chat_template") or CHATML_TEMPLATE
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            token_id = metadata.get(key)
            return str(tokens[token_id]) if token_id is not None and 0 <= token_id < len(tokens) else ""

        return cls(str(source), bos_token=text("tokenizer.ggml.bos_token_id"), eos_token=text("tokenizer.ggml.eos_token_id"))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
               max_chars: int | None = None, **kwargs: Any) -> str:
        """The prompt text for ``messages``; ``kwargs`` (``tools``, ``enable_thinking``...) reach the template.
        With ``max_chars``, output past it stops the render (TemplateLimitError)."""
        now = datetime.now()
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None, "documents": None,
                   # today, as llama.cpp gives it to templates (Llama 3's date_string, FireFunction's datetime)
                   "date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"), **kwargs}
        try:
            if max_chars is None:
                return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
            parts, size = [], 0
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **context):
                size += len(piece)
                if size > max_chars:
                    raise TemplateLimitError(f"produced more than {max_chars} characters (--template-max-mib); "
                                             "it was stopped")
                parts.append(piece)
            return "".join(parts)
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise RequestError(f"the chat template failed on the messages: {type(exc).__name__}: {exc}") from exc
