"""`strata chat` on a terminal: a prompt, a streamed reply, the next prompt, /exit; the conversation
is kept between turns."""

from __future__ import annotations

import io
import logging
import os
import sys

import pexpect
import pytest

PROMPT = "\r\n> "  # the chat's prompt marker at the start of a line


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(expert_type="Q8_0")


def spawn(model, *args: str) -> pexpect.spawn:
    """``strata chat`` on a pseudo-terminal (logs at INFO, as a user would see them)."""
    env = {**os.environ, "STRATA_LOG_LEVEL": "INFO"}
    return pexpect.spawn(sys.executable, ["-m", "strata_core", "chat", "-m", str(model), "-n", "8",
                                          "--temperature", "0", *args],
                         env=env, encoding="utf-8", timeout=120, dimensions=(24, 200))


def test_chat_replies_turn_by_turn_and_exits(model) -> None:
    chat = spawn(model)
    chat.expect("/exit")  # the banner says how to quit
    chat.expect_exact("> ")
    chat.sendline("hello there")
    chat.expect_exact("hello there")  # the terminal's echo
    chat.expect_exact(PROMPT)
    first = chat.before
    assert first.strip(), "no reply text before the next prompt"
    assert "INFO" not in first  # no log line between the reply's tokens
    chat.sendline("and again")
    chat.expect_exact(PROMPT)
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_chat_keeps_the_conversation_and_reset_forgets_it(model, monkeypatch, capsys) -> None:
    """Each turn renders the whole conversation (the user lines and the replies), /reset empties it."""
    from strata_core.cli import main
    from strata_core.text.chat import ChatTemplate

    rendered: list[list[dict[str, str]]] = []
    render = ChatTemplate.render

    def spy(self, messages, *args, **kwargs):  # type: ignore[no-untyped-def]
        rendered.append([dict(m) for m in messages])
        return render(self, messages, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nhow are you\n/reset\nhello\n"))
    handlers = list(logging.root.handlers)
    try:
        assert main(["chat", "-m", str(model), "-n", "4", "--temperature", "0"]) == 0
    finally:
        logging.root.handlers[:] = handlers
    assert [[m["role"] for m in turn] for turn in rendered] == [
        ["user"], ["user", "assistant", "user"], ["user"]]
    first, second, after_reset = rendered
    assert second[0] == first[0] and second[2] == {"role": "user", "content": "how are you"}
    assert second[1]["content"] and second[1]["content"] in capsys.readouterr().out  # the reply as streamed
    assert after_reset == first
