"""Grammars in the sampler: what each request constraint compiles to, the window's bitmask applied to
the constrained rows only (the others bit-identical to a window without any grammar), the grammar
advanced by each sampled token and complete at its end, and bad grammars refused with the reason."""

from __future__ import annotations

import json

import jsonschema
import pytest
import tokenizers
import torch
from test_server_support import VOCAB, FakeTokenizer, _byte_level_chars

from strata_core.errors import InvalidParamError
from strata_core.serving.grammar import (Grammars, gbnf_grammar, json_schema_grammar, server_grammar, strict_tools_grammar,
                                        tool_call_grammar)
from strata_core.serving.sampling import Sampler, SamplingParams, sample_rows
from strata_core.serving.token_mask import apply_bitmask, fill_bitmask
from strata_core.serving.tool_calls import ReplyFormat, parse_reply

TOK = FakeTokenizer()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOK, VOCAB)


def _allowed(mask: torch.Tensor) -> list[int]:
    return [t for t in range(VOCAB) if (int(mask[t // 32]) >> (t % 32)) & 1]


def _text(tokens: list[int]) -> str:
    return TOK.decode(tokens)


def _generate(sampler: Sampler, seed: int, limit: int = 200) -> list[int]:
    """Sample ``sampler`` alone on random logits until its grammar is complete."""
    g = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(limit):
        (result,) = sample_rows(torch.randn(1, VOCAB, generator=g) * 3, [(sampler, tokens)])
        tokens.append(result.token)
        if result.complete or result.token in TOK.eos_token_ids:
            return tokens
    raise AssertionError(f"no end after {limit} tokens: {_text(tokens)!r}")


def test_the_mask_allows_what_the_grammar_allows_next(grammars: Grammars) -> None:
    constraint = grammars.compile(json_schema_grammar(SCHEMA, "json_schema"), "json_schema")
    (row,) = fill_bitmask([constraint], VOCAB)
    assert [_text([t]) for t in _allowed(row)] == ["{"]
    for token in TOK.encode('{"n": 42}'):
        assert not constraint.advance(token) or token == TOK.encode("}")[0]
    assert constraint.matcher.is_stopped()
    assert set(_allowed(fill_bitmask([constraint], VOCAB)[0])) == TOK.eos_token_ids  # only an end may follow


def test_unconstrained_rows_are_bit_identical_to_a_window_without_grammars(grammars: Grammars) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, top_k=20, seed=5, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7)]

    def window(constrained: bool) -> list:
        samplers = [Sampler(p) for p in params]
        if constrained:
            samplers.insert(1, Sampler(SamplingParams(temperature=1.0, seed=3),
                                       grammars.compile(json_schema_grammar(SCHEMA, "x"), "x")))
        rows = [(s, [5, 6, 7]) for s in samplers]
        return sample_rows(logits if constrained else logits[[0, 2, 3]], rows)

    free, mixed = window(False), window(True)
    assert [mixed[0], mixed[2], mixed[3]] == free
    assert _text([mixed[1].token]) == "{"
    x = logits.clone()
    masked = apply_bitmask(x, fill_bitmask([grammars.compile(json_schema_grammar(SCHEMA, "x"), "x")], VOCAB), [2])
    assert torch.equal(masked[[0, 1, 3]], logits[[0, 1, 3]]) and torch.equal(x, logits)
    assert torch.isinf(masked[2]).sum() == VOCAB - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_window_on_cuda_masks_and_samples_as_on_the_cpu(grammars: Grammars) -> None:
    """The bitmask copied to the device masks the same logits, and a mixed window samples the same
    tokens on CUDA as on the CPU."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    mask = fill_bitmask([grammars.compile(json_schema_grammar(SCHEMA, "x"), "x")], VOCAB)
    on_cuda = apply_bitmask(logits.cuda(), mask.cuda(), [1]).cpu()
    assert torch.equal(on_cuda, apply_bitmask(logits, mask, [1]))

    def window(device: str) -> list[int]:
        samplers = [Sampler(SamplingParams(temperature=0)),
                    Sampler(SamplingParams(temperature=0), grammars.compile(json_schema_grammar(SCHEMA, "x"), "x"))]
        return [r.token for r in sample_rows(logits[:2].to(device), [(s, [5, 6]) for s in samplers])]

    assert window("cuda") == window("cpu")


def test_a_sampled_sequence_follows_its_grammar_to_the_end(grammars: Grammars) -> None:
    for seed in range(5):
        constraint = grammars.compile(json_schema_grammar(SCHEMA, "x"), "x")
        tokens = _generate(Sampler(SamplingParams(temperature=1.0, seed=seed), constraint), seed)
        value = json.loads(_text(tokens))
        assert list(value) == ["n"] and 0 <= value["n"] <= 99


def test_gbnf_and_lark_grammars(grammars: Grammars) -> None:
    gbnf = 'root ::= greeting " " [a-z]{1,6} "!"\ngreeting ::= "hello" | "hi"\n'
    for seed in range(3):
        tokens = _generate(Sampler(SamplingParams(temperature=1.0, seed=seed), grammars.compile(
            gbnf_grammar(gbnf, "grammar"), "grammar")), seed)
        text = _text(tokens)
        assert text.split(" ")[0] in ("hello", "hi") and text.endswith("!"), text
    lark = gbnf_grammar('start: "yes" | "no"', "grammar")
    assert _text(_generate(Sampler(SamplingParams(temperature=0), grammars.compile(lark, "grammar")), 0)) in ("yes", "no")


@pytest.mark.parametrize(("make", "words"), [
    (lambda: gbnf_grammar('root ::= "a" | undefined-rule', "grammar"), "undefined-rule"),
    (lambda: gbnf_grammar("root ::= (", "grammar"), "GBNF"),
    (lambda: json_schema_grammar([1, 2], "json_schema"), "JSON schema object"),
])
def test_bad_grammars_name_the_problem(make, words: str) -> None:
    with pytest.raises(InvalidParamError, match=words):
        make()


def test_a_schema_that_cannot_be_enforced_is_refused_at_compile(grammars: Grammars) -> None:
    with pytest.raises(InvalidParamError, match="json_schema cannot be enforced.*foo") as error:
        grammars.compile(json_schema_grammar({"type": "foo"}, "json_schema"), "json_schema")
    assert error.value.param == "json_schema"


def test_server_grammar_from_flags(tmp_path) -> None:
    assert server_grammar(None, None) is None
    assert server_grammar(None, json.dumps(SCHEMA))[1] == "--json-schema"
    (tmp_path / "g.gbnf").write_text('root ::= "x"')
    assert server_grammar(tmp_path / "g.gbnf", None)[1] == "--grammar-file"
    with pytest.raises(ValueError, match="--json-schema.*not JSON|--json-schema: Expecting"):
        server_grammar(None, "{")
    with pytest.raises(ValueError, match="--grammar-file: .*No such file"):
        server_grammar(tmp_path / "missing.gbnf", None)
    with pytest.raises(ValueError, match="--json-schema cannot be enforced"):
        server_grammar(None, '{"type": "foo"}')


def test_objects_get_no_keys_their_schema_does_not_name(grammars: Grammars) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "object", "properties": {"b": {"type": "boolean"}}}}}}
    constraint = grammars.compile(json_schema_grammar(open_schema, "x"), "x")
    assert constraint.matcher.validate_tokens(TOK.encode('{"a": [{"b": true}]}')) == len('{"a": [{"b": true}]}')
    assert constraint.matcher.validate_tokens(TOK.encode('{"a": [{"c"')) == len('{"a": [{"')
    assert constraint.matcher.validate_tokens(TOK.encode('{"z"')) == 2
    explicit = grammars.compile(json_schema_grammar({**open_schema, "additionalProperties": True}, "x"), "x")
    assert explicit.matcher.validate_tokens(TOK.encode('{"z": 1}')) == len('{"z": 1}')


def test_tool_call_grammars(grammars: Grammars) -> None:
    tools = [("get_weather", SCHEMA), ("noop", None)]
    for parallel in (False, True):
        constraint = grammars.compile(tool_call_grammar("hermes", tools, parallel), "tool_choice")
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"n": 7}}\n</tool_call>'
        assert constraint.matcher.consume_tokens(TOK.encode(text))
        assert constraint.matcher.is_stopped() is not parallel
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"n": "x"'
    constraint = grammars.compile(tool_call_grammar("hermes", tools, False), "tool_choice")
    assert constraint.matcher.validate_tokens(TOK.encode(bad)) < len(TOK.encode(bad))



class _DeepSeekTokenizer:
    """Byte-level like FakeTokenizer, with DeepSeek's end of sentence and tool-call tokens as specials."""

    SPECIALS = ["<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]
    eos_token_ids = {0}

    def __init__(self) -> None:
        byte_chars = _byte_level_chars()
        n = len(self.SPECIALS)
        vocab = {s: i for i, s in enumerate(self.SPECIALS)} | {byte_chars[b]: b + n for b in range(256)}
        self.backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], fuse_unk=False))
        self.backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self.backend.decoder = tokenizers.decoders.ByteLevel()
        self.backend.add_special_tokens(self.SPECIALS)


@pytest.mark.parametrize("call_format", ["deepseek", "deepseek-v3.1"])
def test_deepseek_tool_call_grammar_gives_calls_valid_for_the_schema(call_format: str) -> None:
    """Random draws under a forced DeepSeek call (its tool-call tokens as special tokens): the reply is
    one section of calls that the reply parser reads, each to the tool with arguments valid for its schema."""
    tok = _DeepSeekTokenizer()
    n_vocab = len(tok.SPECIALS) + 256
    grammars = Grammars(tok, n_vocab)
    strict = strict_tools_grammar(call_format, [("get_weather", SCHEMA)], True)
    text = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + ("function<｜tool▁sep｜>get_weather\n```json\n"
            '{"n": 3}\n```' if call_format == "deepseek" else 'get_weather<｜tool▁sep｜>{"n": 3}')
            + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    ids = tok.backend.encode(text).ids
    assert grammars.compile(strict, "tools").matcher.consume_tokens(ids)  # strict: text, then the section
    bad = tok.backend.encode(text.replace('"n": 3', '"n": 300')).ids
    assert grammars.compile(strict, "tools").matcher.validate_tokens(bad) < len(bad)
    for seed in range(4):
        constraint = grammars.compile(tool_call_grammar(call_format, [("get_weather", SCHEMA)], True), "tool_choice")
        gen = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        while not constraint.matcher.is_stopped() and len(tokens) < 400:
            mask = fill_bitmask([constraint], n_vocab)[0]
            allowed = [t for t in range(n_vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]
            token = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
            constraint.advance(token)
            tokens.append(token)
        assert constraint.matcher.is_stopped()
        text = tok.backend.decode(tokens, skip_special_tokens=False)
        _, content, calls = parse_reply(text, ReplyFormat(tools=call_format).parser())
        assert content.replace("<｜end▁of▁sentence｜>", "") == "" and calls, text
        for call in calls:
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), SCHEMA)


@pytest.mark.parametrize("think, opening", [("tags", "<think>"), ("open", "")])
@pytest.mark.parametrize("call_format, call", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"n": 7}}\n</tool_call>'),
    ("json", '{"tool_calls": [{"name": "get_weather", "arguments": {"n": 7}}]}')])
def test_forced_calls_may_follow_think_reasoning(grammars: Grammars, think: str, opening: str, call_format: str,
                                                 call: str) -> None:
    """A forced call after a ``<think>`` block (its rest when the prompt opened it; optional with "tags"),
    the block ending at its first ``</think>``; no other text before the call."""
    tools = [("get_weather", SCHEMA)]
    for text in (f"{opening}Which city? Zürich.</think>\n\n{call}", f"{opening}</think>{call}"):
        constraint = grammars.compile(tool_call_grammar(call_format, tools, False, think), "tool_choice")
        assert constraint.matcher.consume_tokens(TOK.encode(text)), text
        assert constraint.matcher.is_stopped()
    if think == "tags":
        assert grammars.compile(tool_call_grammar(call_format, tools, False, think),
                                "tool_choice").matcher.consume_tokens(TOK.encode(call))
    for bad in (f"{opening}hm</think>Sure, calling it. {call}", f"Hello {call}"):
        constraint = grammars.compile(tool_call_grammar(call_format, tools, False, think), "tool_choice")
        ids = TOK.encode(bad)
        if think == "open" and bad.startswith("Hello"):
            continue  # inside the opened block any text is reasoning
        assert constraint.matcher.validate_tokens(ids) < len(ids), bad


def test_strict_tools_grammar_hermes(grammars: Grammars) -> None:
    """Free text around ``<tool_call>`` blocks, each valid for its tool (a tool not marked strict: any
    object); at most one block unless parallel."""
    tools = [("get_weather", SCHEMA), ("noop", None)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"n": 7}}\n</tool_call>'
    free = '<tool_call>\n{"name": "noop", "arguments": {"anything": [1]}}\n</tool_call>'
    for parallel in (True, False):
        grammar = strict_tools_grammar("hermes", tools, parallel)
        for text in ("Just text, a < b.", f"Let me look.\n{call}", f"{free}\nthen text"):
            assert grammars.compile(grammar, "tools").matcher.consume_tokens(TOK.encode(text)), text
        for bad in (call.replace('"n": 7', '"n": "x"'), call.replace("get_weather", "other")):
            ids = TOK.encode(bad)
            assert grammars.compile(grammar, "tools").matcher.validate_tokens(ids) < len(ids), bad
        ids = TOK.encode(f"{call}\n{call}")
        assert (grammars.compile(grammar, "tools").matcher.validate_tokens(ids) == len(ids)) is parallel


def test_strict_tools_grammar_json_and_harmony(grammars: Grammars) -> None:
    grammar = strict_tools_grammar("json", [("get_weather", SCHEMA)], False)
    for text in ('{"response": "hi"}', '{"tool_calls": [{"name": "get_weather", "arguments": {"n": 1}}]}'):
        assert grammars.compile(grammar, "tools").matcher.consume_tokens(TOK.encode(text)), text
    ids = TOK.encode('{"tool_calls": [{"name": "get_weather", "arguments": {"n": -1}}]}')
    assert grammars.compile(grammar, "tools").matcher.validate_tokens(ids) < len(ids)
    assert strict_tools_grammar("harmony", [("get_weather", SCHEMA)], True) is None
