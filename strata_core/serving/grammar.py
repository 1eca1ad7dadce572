"""Grammars that constrain what a request may generate, enforced with llguidance.

A request's constraint (a JSON schema, any JSON object, a GBNF or Lark grammar, or a forced tool
call in the model family's wrapper) becomes an llguidance grammar here (``*_grammar``, each
raising ``InvalidParamError`` naming the request field for a text that is not one).
:class:`Grammars` compiles a grammar against the model's tokenizer into a :class:`TokenConstraint`,
one per request, which allows the tokens the grammar accepts next and advances with each sampled
token. The tokenizer's llguidance form (a token trie over the whole vocabulary, the expensive part)
is built once per :class:`Grammars`, on its first compile.

JSON is generated with at most ``MAX_WHITESPACE`` white-space characters between two tokens of it,
and an object schema with ``properties`` but no ``additionalProperties`` gets no other keys, as in
llama.cpp's schema grammars: a model cannot spend its budget on indentation or invented keys.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance

from strata_core.errors import InvalidParamError
from strata_core.serving.generic_calls import call_schema

__all__ = ["Grammars", "TokenConstraint", "gbnf_grammar", "json_schema_grammar", "server_grammar", "tool_call_grammar"]

MAX_WHITESPACE = 20
#: llguidance's JSON options for every schema (its "x-guidance" key)
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}


#: the keywords whose value is a subschema, a list of them, or a map of names to them
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that has ``properties``
    and says nothing of other keys (a copy; every subschema too)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lark_json(schema: Any, param: str) -> str:
    """A Lark expression matching JSON valid for ``schema`` (an object)."""
    if not isinstance(schema, dict):
        raise InvalidParamError(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    return "%json " + json.dumps({**_closed(schema), "x-guidance": JSON_OPTIONS})


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON valid for ``schema`` (``{"type": "object"}``: any JSON object)."""
    return llguidance.LLMatcher.grammar_from_lark(f"start: {_lark_json(schema, param)}\n")


def gbnf_grammar(text: str, param: str) -> str:
    """The grammar of a GBNF text (llama.cpp's grammar format; a Lark text is taken as it is)."""
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as exc:
        raise InvalidParamError(f"{param} is not a valid GBNF grammar: {exc}", param) from None


def _literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


#: the rule ``reasoning`` of a forced call's grammar by ``ReplyFormat.think``: a whole ``<think>`` block, or
#: the rest of the one the prompt opened (a lazy lexeme ending at the first ``</think>``); then the white
#: space before the call
_THOUGHT = 'thought[suffix="</think>"]: /(.|\\n)*/\nGAP: /[ \\t\\n]*/'
_REASONING = {"tags": 'reasoning: "<think>" thought GAP\n' + _THOUGHT, "open": "reasoning: thought GAP\n" + _THOUGHT}


def _call_rules(call_format: str, tools: Sequence[tuple[str, dict[str, Any] | None]], opened: bool = False) -> list[str]:
    """Rules ``call_0 ...`` of one call to each of ``tools`` in ``call_format``, arguments valid for the
    tool's schema; ``opened``: the hermes call's ``<tool_call>`` already read (a lazy lexeme's suffix)."""
    rules = []
    for i, (name, parameters) in enumerate(tools):
        arguments = _lark_json(parameters if parameters is not None else {"type": "object"}, "tools")
        if call_format == "harmony":
            rules.append(f"call_{i}: <|channel|> {_literal(f'commentary to=functions.{name} ')} <|constrain|> "
                         f"\"json\" <|message|> {arguments} <|call|>")
        elif call_format.startswith("deepseek"):
            fenced = call_format == "deepseek"
            head = (f"{_literal('function')} <｜tool▁sep｜> {_literal(name + chr(10) + '```json' + chr(10))}"
                    if fenced else f"{_literal(name)} <｜tool▁sep｜>")
            tail = f" {_literal(chr(10) + '```')}" if fenced else ""
            rules.append(f"call_{i}: <｜tool▁call▁begin｜> {head} {arguments}{tail} <｜tool▁call▁end｜>")
        else:
            opening = ("" if opened else "<tool_call>") + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) \
                + ', "arguments": '
            rules.append(f"call_{i}: {_literal(opening)} {arguments} {_literal(chr(10).join(['}', '</tool_call>']))}")
    return rules


def tool_call_grammar(call_format: str, tools: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool,
                      think: str | None = None) -> str:
    """The grammar of a reply that is tool calls only, in ``call_format`` ("hermes": ``<tool_call>``
    JSON blocks, one or more when ``parallel``; "harmony": one call to ``functions.NAME`` on the
    commentary channel, ending with ``<|call|>``; "deepseek" / "deepseek-v3.1": DeepSeek's section
    of calls, one or more when ``parallel``, each ``function<｜tool▁sep｜>NAME`` and fenced JSON
    arguments / V3.1's ``NAME<｜tool▁sep｜>ARGUMENTS``), to one of ``tools`` (name, parameters
    schema; None: any object), its arguments valid for the tool's schema; "json": the generic
    format's ``{"tool_calls": [...]}`` object (strata_core.serving.generic_calls). Reasoning may come
    first: harmony's analysis message; with ``think`` (``ReplyFormat.think``) a ``<think>`` block
    ("open": the rest of the block the prompt opened)."""
    rules = [_REASONING[think]] if think is not None else []
    first = "reasoning " if think == "open" else "reasoning? " if think is not None else ""
    if call_format == "json":
        schema = _lark_json(call_schema(tools, parallel), "tools")
        return llguidance.LLMatcher.grammar_from_lark(f"start: {first}{schema}\n" + "\n".join(rules) + "\n")
    if call_format == "harmony":
        rules.append(f"analysis: <|channel|> {_literal('analysis')} <|message|> ANALYSIS <|end|> <|start|> "
                     f"{_literal('assistant')}\nANALYSIS: /(.|\\n)*/")
        first = "analysis? "
    rules += _call_rules(call_format, tools)
    call = " | ".join(f"call_{i}" for i in range(len(tools)))
    if call_format.startswith("deepseek"):
        start = f"<｜tool▁calls▁begin｜> ({call}){'+' if parallel else ''} <｜tool▁calls▁end｜>"
    else:
        start = f"({call})" + (f' ("\\n" ({call}))*' if parallel and call_format == "hermes" else "")
    return llguidance.LLMatcher.grammar_from_lark(f"start: {first}{start}\n" + "\n".join(rules) + "\n")


#: free text of a reply with ``strict`` tools: anything without the hermes opening tag (which starts a call)
_FREE_TEXT = "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/"


def strict_tools_grammar(call_format: str, tools: Sequence[tuple[str, dict[str, Any] | None]],
                         parallel: bool) -> str | None:
    """The grammar of a reply that may call ``tools`` (``tool_choice`` auto, a tool marked ``strict``):
    any text, but a call, once it starts, valid for its tool's schema (several when ``parallel``) —
    hermes: free text around ``<tool_call>`` blocks; deepseek: free text, then at most one section of
    calls; json: the generic format's calls or response object. None for harmony (its calls are left
    free)."""
    if call_format == "harmony":
        return None
    if call_format == "json":
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        return json_schema_grammar({"anyOf": [call_schema(tools, parallel), response]}, "tools")
    rules = _call_rules(call_format, tools, opened=call_format == "hermes")
    call = " | ".join(f"call_{i}" for i in range(len(tools)))
    if call_format == "hermes":
        start = f"(opening ({call}))* TEXT" if parallel else f"(opening ({call}))? TEXT"
        rules += ['opening[suffix="<tool_call>"]: /(.|\\n)*/', _FREE_TEXT]
    else:
        section = f"<｜tool▁calls▁begin｜> ({call}){'+' if parallel else ''} <｜tool▁calls▁end｜>"
        start = f"TEXT ({section} TEXT)?"
        rules.append("TEXT: /(.|\\n)*/")
    return llguidance.LLMatcher.grammar_from_lark(f"start: {start}\n" + "\n".join(rules) + "\n")


def server_grammar(grammar_file: Path | None, json_schema: str | None) -> tuple[str, str] | None:
    """The server-wide grammar (``--json-schema`` text, else a ``--grammar-file``) and its flag, None
    without either; ValueError naming the flag for one that cannot be read or is not valid."""
    flag = "--json-schema" if json_schema is not None else "--grammar-file"
    try:
        if json_schema is not None:
            grammar = json_schema_grammar(json.loads(json_schema), flag)
        elif grammar_file is not None:
            grammar = gbnf_grammar(Path(grammar_file).read_text(encoding="utf-8"), flag)
        else:
            return None
    except (OSError, ValueError, InvalidParamError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if error := llguidance.LLMatcher.validate_grammar(grammar):
        raise ValueError(f"{flag} cannot be enforced: {error}")
    return grammar, flag


class TokenConstraint:
    """One request's grammar state: the tokens it allows next, advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; True when the grammar is complete (only an end token may follow).
        Raises RuntimeError for a token the grammar does not allow."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar does not allow token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


class Grammars:
    """Compiles grammars against one tokenizer (a :class:`~strata_core.text.tokenizer.Tokenizer`
    or one with the same ``backend`` and ``eos_token_ids``) for logits of ``n_vocab`` columns."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer's llguidance form, built on first use (under a lock: one build)."""
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.n_vocab,
                                                  eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll

    def compile(self, grammar: str, param: str) -> TokenConstraint:
        """A fresh constraint for one request; InvalidParamError naming ``param`` for a grammar that
        does not compile (an unsupported schema keyword, a rule that is never defined)."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParamError(f"{param} cannot be enforced: {matcher.get_error()}", param)
        return TokenConstraint(matcher)
