"""Chat template rendering: Qwen-style ChatML, transformers parity, fallback and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from strata_core.text.chat import CHATML_TEMPLATE, ChatTemplate
from strata_core.errors import ModelFileError, RequestError
from strata_core.gguf.reader import GGUFFile

# Qwen2.5's template (tools, tool calls, tool responses).
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — températures in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks."},
]


def _metadata(template: str | None) -> dict:
    meta = {"tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"], "tokenizer.ggml.eos_token_id": 2}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return meta


def test_qwen_template_renders_chatml() -> None:
    chat = ChatTemplate.from_gguf(_metadata(QWEN_TEMPLATE))
    prompt = chat.render([{"role": "user", "content": "Hello!"}])
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not chat.render([{"role": "user", "content": "Hello!"}], add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_matches_transformers_rendering(add_generation_prompt: bool, tools: list | None) -> None:
    expected = render_jinja_template(
        [CONVERSATION], tools=tools, chat_template=QWEN_TEMPLATE, add_generation_prompt=add_generation_prompt
    )[0][0]
    chat = ChatTemplate.from_gguf(_metadata(QWEN_TEMPLATE))
    got = chat.render(CONVERSATION, add_generation_prompt=add_generation_prompt, tools=tools)
    assert got == expected
    assert '"arguments": {"city": "Zürich"}' in got  # tojson keeps non-ASCII text


def test_missing_template_falls_back_to_chatml() -> None:
    chat = ChatTemplate.from_gguf(_metadata(None))
    assert chat.source == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_token_texts_reach_the_template() -> None:
    chat = ChatTemplate.from_gguf(_metadata("{{ bos_token }}|{{ eos_token }}"))
    assert chat.render([]) == "|<|im_end|>"


def test_raise_exception_becomes_request_error() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    chat = ChatTemplate(template)
    assert chat.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(RequestError, match="Conversation must start with user"):
        chat.render([{"role": "assistant", "content": "x"}])


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(ModelFileError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_sandbox_blocks_python_internals() -> None:
    chat = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError):
        chat.render([])


def test_generation_tag_renders_its_body() -> None:
    chat = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert chat.render([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "[a][b]"


def test_demo_model_stores_chatml() -> None:
    meta = GGUFFile.open(Path(__file__).parents[1] / "strata_core" / "data" / "demo-qwen3moe-q8_0.gguf").metadata
    assert meta["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert ChatTemplate.from_gguf(meta).eos_token == "<|im_end|>"


def test_todays_date_reaches_the_template_as_llama_cpp_gives_it() -> None:
    """Llama 3's templates read date_string, FireFunction's datetime; a request's own value wins."""
    from datetime import date

    chat = ChatTemplate("{{ date_string }}|{{ datetime }}")
    today = date.today()
    assert chat.render([]) == f"{today.strftime('%d %b %Y')}|{today.strftime('%b %d %Y')}"
    assert chat.render([], date_string="26 Jul 2024").startswith("26 Jul 2024|")
