"""The chat page in a real headless Chromium (selenium and Debian's chromium + chromium-driver): the
key asked for on a 401, a streamed reply of the fake engine rendered, conversations kept across a
reload, reasoning, tool calls and timings shown. Skipped where no Chromium or driver is installed.

Every wait is bounded (WAIT_S), so a page that never renders fails in seconds, not at a CI limit.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_support import FakeEngine, FakeTokenizer, greedy_reference, live_server

from strata_core.config import StrataSettings

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT_S = 10
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no chromium and chromedriver on PATH (apt-get install chromium chromium-driver)")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,800"):
        options.add_argument(arg)
    # both paths given: selenium's driver manager has nothing to look up or download
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, condition, what: str):
    """``condition(driver)``'s first truthy value, or a failure naming ``what`` after WAIT_S seconds."""
    return WebDriverWait(driver, WAIT_S).until(condition, message=f"timed out waiting for {what}")


def fill(driver: WebDriver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def last_reply(driver: WebDriver):
    """The last assistant message once it has finished streaming, else None."""
    done = driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant[data-state=done]")
    return done[-1] if done and not driver.find_elements(By.CSS_SELECTOR, "[data-state=streaming]") else None


def screenshot(driver: WebDriver, path: Path) -> None:
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 0
    print(f"screenshot: {path}")


def test_chat_with_the_fake_engine(browser: WebDriver, tmp_path: Path) -> None:
    settings = StrataSettings(model_alias="demo", api_key="sesame", parallel=1)
    with live_server(settings, FakeEngine()) as url:
        browser.get(f"{url}/")
        # the page's first API call is answered 401: it asks for the key
        wait_for(browser, lambda d: d.execute_script("return document.getElementById('key-dialog').open"),
                 "the API key dialog")
        fill(browser, "api-key", "sesame")
        browser.find_element(By.ID, "key-ok").click()
        wait_for(browser, lambda d: d.find_element(By.ID, "model").text == "demo", "the model name")

        fill(browser, "system", "be brief")
        fill(browser, "temperature", "0")
        fill(browser, "max_tokens", "12")
        fill(browser, "prompt", "hello")
        browser.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
        reply = wait_for(browser, last_reply, "the streamed reply")

        prompt = FakeTokenizer().encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                                        "<|im_start|>assistant\n")
        expected = FakeTokenizer().decode(greedy_reference(prompt, 12))
        assert reply.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent") == expected
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        assert "tok/s" in stats and f"prompt {len(prompt)} tokens" in stats
        assert not reply.find_elements(By.CSS_SELECTOR, ".error")
        screenshot(browser, tmp_path / "webui-chat.png")

        # the conversation and the key are kept in the browser: a reload shows it, no key asked for
        browser.refresh()
        wait_for(browser, lambda d: d.find_element(By.ID, "model").text == "demo", "the model name after a reload")
        assert browser.find_element(By.CSS_SELECTOR, "#conversations li.current span").text == "hello"
        again = wait_for(browser, last_reply, "the kept reply")
        assert again.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent") == expected
        assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"


# A stream as a reasoning model with tools would send it: the page's fetch of the chat route answers it.
CANNED = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user greets; "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "look up the weather."}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                        "function": {"name": "weather", "arguments": "{\"city\":"}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": " \"Oslo\"}"}}]}}]},
    {"choices": [{"index": 0, "delta": {"content": "It is sunny."}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
     "timings": {"prompt_n": 9, "prompt_ms": 3.0, "prompt_per_second": 3000.0, "predicted_n": 5,
                 "predicted_ms": 119.0, "predicted_per_second": 42.0, "cache_n": 2}},
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}},
]

FAKE_FETCH = """
const chunks = arguments[0];
const realFetch = window.fetch;
window.fetch = (path, options) => {
  if (path !== "/v1/chat/completions") return realFetch(path, options);
  window.sentBody = JSON.parse(options.body);
  const text = chunks.map((c) => `data: ${JSON.stringify(c)}\\n\\n`).join("") + "data: [DONE]\\n\\n";
  return Promise.resolve(new Response(text, { headers: { "Content-Type": "text/event-stream" } }));
};
"""


def test_reasoning_tool_calls_and_timings(browser: WebDriver, tmp_path: Path) -> None:
    with live_server(StrataSettings(model_alias="demo", parallel=1), FakeEngine()) as url:
        browser.get(f"{url}/")
        wait_for(browser, lambda d: d.find_element(By.ID, "model").text == "demo", "the model name")
        browser.execute_script(FAKE_FETCH, CANNED)
        fill(browser, "top_p", "0.5")
        fill(browser, "stop_strings", "END\nSTOP")
        fill(browser, "prompt", "weather?")
        browser.find_element(By.ID, "send").click()
        reply = wait_for(browser, last_reply, "the canned reply")

        reasoning = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
        reasoning.find_element(By.TAG_NAME, "summary").click()
        assert reasoning.find_element(By.TAG_NAME, "div").text == "The user greets; look up the weather."
        assert reply.find_element(By.CSS_SELECTOR, ".content").text == "It is sunny."
        assert reply.find_element(By.CSS_SELECTOR, ".tool-call").text == 'tool call weather({"city": "Oslo"})'
        stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
        assert stats == "5 tokens · 42.0 tok/s · prompt 9 tokens at 3000.0 tok/s · 2 cached · finish: stop"
        sent = browser.execute_script("return window.sentBody")
        assert sent["model"] == "demo" and sent["stream"] is True and sent["top_p"] == 0.5
        assert sent["stop"] == ["END", "STOP"] and "system" not in [m["role"] for m in sent["messages"]]
        assert sent["messages"] == [{"role": "user", "content": "weather?"}]
        screenshot(browser, tmp_path / "webui-reasoning.png")
