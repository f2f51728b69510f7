"""The run page's live panel in a real browser (headless Chromium): what the model writes
appears while its call is still open, as text (escaped: the console's CSP and no HTML from
data), and the answer stays the durable one (I28)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.console.conftest import Console, screenshot
from tests.console.test_pages import css, open_task, retry, text_of
from tests.support.cluster import Cluster
from tests.support.fake_openai import FakeOpenAI, chat_stream

pytestmark = [pytest.mark.timeout(240)]

WRITTEN = 'Hi <b id="bold">there</b> & <img src=x id="evil"> the rest of the answer.'


def test_the_run_page_shows_the_text_as_the_model_writes_it(
    console: Console,
    browser: Any,
    cluster: Cluster,
    model_server: FakeOpenAI,
    screenshots: Path,
) -> None:
    held = chat_stream(WRITTEN, hold_at=5, hold_seconds=120)  # four pieces, then held
    model_server.enqueue(held)
    task_id = charlie.submit("write", model="openai:fake-console")
    try:
        open_task(browser, console, task_id)
        first = WRITTEN[:16]
        retry(lambda: text_of(browser, "#live-text").startswith(first), timeout=90)
        assert not held.release.is_set()  # the call is still open
        assert css(browser, "#live-model").get_attribute("data-state") == "writing"
        assert "is writing" in text_of(browser, "#live-call")
        screenshot(browser, screenshots, "live-model-writing")
    finally:
        held.release.set()
    retry(lambda: text_of(browser, "#live-text") == WRITTEN, timeout=90)
    retry(lambda: css(browser, "#live-model").get_attribute("data-state") == "completed")
    # the model's markup is text on the page, never elements
    injected = "#bold, #evil, #live-model b, #live-model img"
    assert browser.find_elements("css selector", injected) == []
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED and info.result["answer"] == WRITTEN
