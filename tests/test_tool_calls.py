"""Tool calls read out of replies: Qwen-style ``<tool_call>`` blocks and harmony function calls, whole
and streamed in any split."""

from __future__ import annotations

import json

import pytest

from strata_core.serving.tool_calls import ReplyFormat, ToolCall, parse_reply, tool_call_format
from strata_core.text.harmony import Piece

HERMES = ReplyFormat(tools="hermes")
HARMONY = ReplyFormat(harmony=True, tools="harmony")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def whole(text: str, fmt: ReplyFormat = HERMES) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning, content, calls = parse_reply(text, fmt.parser())
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(pieces: list[str], fmt: ReplyFormat = HERMES) -> tuple[str, str, list[tuple[str, dict]]]:
    parser = fmt.parser()
    items = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    text = {kind: "".join(i.text for i in items if isinstance(i, Piece) and i.kind == kind)
            for kind in ("reasoning", "content")}
    return text["reasoning"], text["content"], [(c.name, json.loads(c.arguments)) for c in items
                                                if isinstance(c, ToolCall)]


REPLIES = [
    "Let me look.\n\n" + CALL + "\n" + CALL.replace("Zürich", "Bern") + "\n",
    "see: <tool_call>{bad json</tool_call> then " + CALL + " after",
    "a < b and <tool not a tag, <tool_call>never closed",
    "no calls at all\n",
]


@pytest.mark.parametrize("text", REPLIES)
def test_any_split_gives_what_the_whole_text_gives(text: str) -> None:
    assert_any_split(text, HERMES)


def assert_any_split(text: str, fmt: ReplyFormat) -> None:
    """Fed a character at a time, or in any two pieces, ``text`` gives what it gives whole."""
    expected = whole(text, fmt)
    assert streamed(list(text), fmt) == expected
    for cut in range(1, len(text)):
        assert streamed([text[:cut], text[cut:]], fmt) == expected


def test_blocks_are_calls_and_the_text_around_them_content() -> None:
    assert whole(REPLIES[0]) == ("", "Let me look.", [("get_weather", {"city": "Zürich"}),
                                                      ("get_weather", {"city": "Bern"})])


def test_a_block_that_is_no_call_is_content_as_it_is() -> None:
    assert whole(REPLIES[1]) == ("", "see: <tool_call>{bad json</tool_call> then after", [("get_weather",
                                                                                         {"city": "Zürich"})])
    assert whole(REPLIES[2]) == ("", REPLIES[2], [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert whole(no_name) == ("", no_name, [])


def test_arguments_given_as_a_json_string_are_read() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert whole(text) == ("", "", [("f", {"a": 1})])


def test_text_that_may_start_a_block_is_held_back() -> None:
    parser = HERMES.parser()
    assert parser.feed("Sure <tool") == [Piece("content", "Sure")]
    assert parser.feed("box>") == [Piece("content", " <toolbox>")]


def test_calls_past_max_calls_are_dropped() -> None:
    fmt = ReplyFormat(tools="hermes", max_calls=1)
    assert whole(REPLIES[0], fmt)[2] == [("get_weather", {"city": "Zürich"})]


def test_each_call_has_its_own_id() -> None:
    calls = parse_reply(REPLIES[0], HERMES.parser())[2]
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls) and calls[0].id != calls[1].id


HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"city": "Paris"}')


def test_harmony_function_call() -> None:
    assert whole(HARMONY_CALL, HARMONY) == ("Need the weather.", "", [("get_weather", {"city": "Paris"})])
    for cut in range(1, len(HARMONY_CALL)):
        assert streamed([HARMONY_CALL[:cut], HARMONY_CALL[cut:]], HARMONY) == whole(HARMONY_CALL, HARMONY)
    # the recipient first, as gpt-oss also writes it
    assert whole(' to=functions.f<|channel|>commentary json<|message|>{"x": 1}', HARMONY) == ("", "", [("f", {"x": 1})])


def test_harmony_calls_without_tools_and_to_other_recipients_are_dropped() -> None:
    assert whole(HARMONY_CALL, ReplyFormat(harmony=True)) == ("Need the weather.", "", [])
    browser = ("<|channel|>commentary to=browser.search<|message|>{}<|end|>"
               "<|start|>assistant<|channel|>final<|message|>ok")
    assert whole(browser, HARMONY) == ("", "ok", [])


def test_harmony_arguments_that_are_not_json_are_content() -> None:
    bad = HARMONY_CALL.replace('{"city": "Paris"}', "Paris please")
    assert whole(bad, HARMONY) == ("Need the weather.", "Paris please", [])


def test_the_format_follows_the_chat_template() -> None:
    assert tool_call_format("{{ '<|channel|>' }}") == "harmony"
    assert tool_call_format("... <tool_call>\\n{...}\\n</tool_call> ...") == "hermes"
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "json"
    assert ReplyFormat().parser() is None  # no tools, no harmony: the text is all content


DEEPSEEK = ReplyFormat(tools="deepseek")
DS_V3 = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Zürich\"}\n```"
         "<｜tool▁call▁end｜>")
DS_V31 = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Bern"}<｜tool▁call▁end｜>'
DS_REPLIES = [
    "Let me look. \n<｜tool▁calls▁begin｜>" + DS_V3 + DS_V31 + "<｜tool▁calls▁end｜>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>not json<｜tool▁call▁end｜>"
    + DS_V31 + "<｜tool▁calls▁end｜> and after",
    "cut short <｜tool▁calls▁begin｜>" + DS_V31 + "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
    "no calls at all, a <｜tool but no tag\n",
]


@pytest.mark.parametrize("text", DS_REPLIES)
def test_deepseek_any_split_gives_what_the_whole_text_gives(text: str) -> None:
    assert_any_split(text, DEEPSEEK)


def test_deepseek_calls_in_both_layouts() -> None:
    """V3 / R1's ``function<｜tool▁sep｜>NAME`` with fenced JSON and V3.1's bare ``NAME<｜tool▁sep｜>JSON``;
    the content before the section, less the white space before it."""
    assert whole(DS_REPLIES[0], DEEPSEEK) == ("", "Let me look.", [("get_weather", {"city": "Zürich"}),
                                                                  ("get_weather", {"city": "Bern"})])


def test_deepseek_bodies_that_are_no_call_are_content_as_they_are() -> None:
    bad = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>not json<｜tool▁call▁end｜>"
    assert whole(DS_REPLIES[1], DEEPSEEK) == ("", bad + " and after", [("get_weather", {"city": "Bern"})])
    unclosed = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"
    assert whole(DS_REPLIES[2], DEEPSEEK) == ("", "cut short" + unclosed, [("get_weather", {"city": "Bern"})])
    assert whole(DS_REPLIES[3], DEEPSEEK) == ("", DS_REPLIES[3], [])


def test_deepseek_calls_past_max_calls_are_dropped() -> None:
    _, _, calls = parse_reply(DS_REPLIES[0], ReplyFormat(tools="deepseek", max_calls=1).parser())
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Zürich"}]


def test_the_deepseek_layout_follows_the_chat_template() -> None:
    v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'}}"
    v31 = "{{'<｜tool▁calls▁begin｜>'}}{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments}}"
    assert tool_call_format(v3) == "deepseek"
    assert tool_call_format(v31) == "deepseek-v3.1"


GENERIC = ReplyFormat(tools="json")
GENERIC_REPLIES = [
    ' {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Bern\\"}"}]}',
    '{"tool_call": {"name": "get_weather", "arguments": {"city": "Zürich"}}}',
    '{"response": "It is warm."}',
    '{"tool_calls": [{"arguments": {}}]}',
    "Plain text, {not json} at all",
]


@pytest.mark.parametrize("text", GENERIC_REPLIES)
def test_generic_any_split_gives_what_the_whole_text_gives(text: str) -> None:
    assert_any_split(text, GENERIC)


def test_generic_replies() -> None:
    """``tool_calls`` (arguments as an object or a JSON string) and ``tool_call`` are calls, ``response``
    is content; an object of neither shape, or a call without a name, is content as it is."""
    assert whole(GENERIC_REPLIES[0], GENERIC) == ("", "", [("get_weather", {"city": "Zürich"}),
                                                          ("get_weather", {"city": "Bern"})])
    assert whole(GENERIC_REPLIES[1], GENERIC) == ("", "", [("get_weather", {"city": "Zürich"})])
    assert whole(GENERIC_REPLIES[2], GENERIC) == ("", "It is warm.", [])
    assert whole(GENERIC_REPLIES[3], GENERIC) == ("", GENERIC_REPLIES[3], [])
    assert whole(GENERIC_REPLIES[4], GENERIC) == ("", GENERIC_REPLIES[4], [])


THINK_REPLIES = [
    ("tags", "<think>\nThe user wants weather.\n</think>\n\n" + CALL, HERMES),
    ("open", "Weather, then.\n</think>\n\nLet me look.\n" + CALL, HERMES),
    ("tags", "  No thinking here, a < b.", HERMES),
    ("tags", "<think>cut short", HERMES),
    ("open", "all reasoning, never closed", ReplyFormat()),
]


@pytest.mark.parametrize("think, text, fmt", THINK_REPLIES)
def test_think_any_split_gives_what_the_whole_text_gives(think: str, text: str, fmt: ReplyFormat) -> None:
    assert_any_split(text, ReplyFormat(fmt.harmony, fmt.tools, fmt.max_calls, think))


def test_think_blocks_are_reasoning() -> None:
    """A leading block (or the rest of the one the prompt opened) is reasoning, the white space after it
    dropped, the rest the reply; a reply that does not open one is all reply; one never closed is all
    reasoning."""
    fmt = [ReplyFormat(tools=f.tools, think=t) for t, _, f in THINK_REPLIES]
    texts = [text for _, text, _ in THINK_REPLIES]
    assert whole(texts[0], fmt[0]) == ("\nThe user wants weather.\n", "", [("get_weather", {"city": "Zürich"})])
    assert whole(texts[1], fmt[1]) == ("Weather, then.\n", "Let me look.", [("get_weather", {"city": "Zürich"})])
    assert whole(texts[2], fmt[2]) == ("", texts[2], [])
    assert whole(texts[3], fmt[3]) == ("cut short", "", [])
    assert whole(texts[4], fmt[4]) == (texts[4], "", [])
    assert ReplyFormat(think=None).parser() is None
