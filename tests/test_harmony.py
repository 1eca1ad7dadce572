"""The harmony output parser (strata_core/text/harmony.py): reasoning / content as llama.cpp's gpt-oss parser
splits them, and the same result for any split of the streamed text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.text.chat import ChatTemplate
from strata_core.cli.info import describe
from strata_core.gguf.reader import GGUFFile
from strata_core.text.harmony import MAX_HEADER, HarmonyParser, Piece, parse, uses_harmony

DATA = Path(__file__).parent / "data"

ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"


@pytest.mark.parametrize("text, reasoning, content", [
    (ANALYSIS + "think<|end|><|start|>assistant<|channel|>final<|message|>answer", "think", "answer"),
    ("<|channel|>final<|message|>only the answer", "", "only the answer"),
    # a commentary preamble is content, then more reasoning, then the answer
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + ANALYSIS + "t2" + NEXT
     + "<|channel|>final<|message|> done", "t2", "Let me check. done"),
    # gpt-oss-20b's stray commentary before a channel; " to=assistant" is no recipient
    ("<|channel|>commentary to=assistant" + ANALYSIS + "r" + NEXT + "<|channel|>final<|message|>c", "r", "c"),
    # a message to a recipient (an unsolicited tool call) gives nothing
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": 1}" + NEXT
     + "<|channel|>final<|message|>ok", "", "ok"),
    # the recipient in the first message's role header (its "<|start|>assistant" ends the prompt)
    (" to=functions.f<|channel|>commentary json<|message|>{}" + NEXT + "<|channel|>final<|message|>x", "", "x"),
    ("too plain", "", "too plain"),
    (ANALYSIS + "cut by max_tokens", "cut by max_tokens", ""),  # no final message yet
    (ANALYSIS + "r" + NEXT + "<|channel|>fin", "r", ""),  # an unfinished header gives nothing
    ("plain text from a model that ignores the format", "", "plain text from a model that ignores the format"),
    ("<|notamarker|> text", "", "<|notamarker|> text"),
    (ANALYSIS + "a < b and <| is not <|end", "a < b and <| is not <|end", ""),  # marker-like text in a body
    ("", "", ""),
])  # fmt: skip
def test_split(text, reasoning, content):
    assert parse(text) == (reasoning, content)


def test_a_header_longer_than_max_header_is_content():
    text = "<|channel|>" + "x" * MAX_HEADER + "<|message|>body"
    assert parse(text) == ("", text)
    assert parse("<|channel|>final" + " " * (MAX_HEADER - 20) + "<|message|>body") == ("", "body")


def test_pieces_keep_the_output_order():
    parser = HarmonyParser()
    text = "<|channel|>commentary<|message|>pre<|end|><|start|>assistant" + ANALYSIS + "why" + NEXT + \
        "<|channel|>final<|message|>ans"
    assert parser.feed(text) + parser.finish() == [Piece("content", "pre"), Piece("reasoning", "why"),
                                                    Piece("content", "ans")]


def test_marker_text_is_held_until_it_is_known():
    parser = HarmonyParser()
    assert parser.feed(ANALYSIS + "abc<|e") == [Piece("reasoning", "abc")]
    assert parser.feed("nd|>") == []
    assert parser.feed("<|start|>assistant<|channel|>final<|mess") == []
    assert parser.feed("age|>x") == [Piece("content", "x")]
    assert parser.finish() == []


@pytest.mark.parametrize("fixture, harmony", [("gpt-oss_llamacpp", True), ("qwen3next_llamacpp", False)])
def test_detection_from_the_template(fixture, harmony):
    path = DATA / fixture / "model-f32.gguf"
    assert uses_harmony(ChatTemplate.from_gguf(GGUFFile.open(path).metadata).source) is harmony
    assert ("chat template: harmony" in describe(path, [8.0])) is harmony  # strata info says it


_PART = st.sampled_from([
    "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "assistant", "analysis", "final", "commentary",
    " to=functions.f", " to=assistant", "to", "=", "<|constrain|>", "json", "<|", "|>", "<", " ", "\n", "text",
    "é",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PART, max_size=30), st.lists(st.integers(0, 400), max_size=8))
def test_any_split_gives_the_whole_result(parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = HarmonyParser()
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in parser.feed(text[a:b])] + parser.finish()
    streamed = ("".join(p.text for p in pieces if p.kind == "reasoning"),
                "".join(p.text for p in pieces if p.kind == "content"))
    assert streamed == parse(text)
    assert all(p.text for p in pieces)
