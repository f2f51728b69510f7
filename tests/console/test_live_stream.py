"""The run page's live panel in a real browser (headless Chromium): what the model writes
appears while its call is still open, as text (escaped: the console's CSP and no HTML from
data), and the answer stays the durable one (I28)."""

from __future__ import annotations

import re
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


def test_the_live_panel_sits_below_the_header_names_calls_as_the_page_does_and_ends(
    console: Console,
    browser: Any,
    cluster: Cluster,
    model_server: FakeOpenAI,
    workspace: Path,
    screenshots: Path,
) -> None:
    """The live panel comes after the run's header, as the other panels do; it names a model
    call by its turn and model and a tool call by its tool, never by the stream's internal
    call id (``1.4.1``); once the task has finished it says so, and a finished task's page has
    no live panel at all."""
    (workspace / "a.txt").write_text("alpha")
    # frames: role, 3 text pieces, the call's opening, then its argument pieces: held there
    held = chat_stream("Let me look.", [("c1", "read_file", '{"path": "a.txt"}')], hold_at=7)
    model_server.enqueue(held, chat_stream("It says alpha."))
    task_id = charlie.submit(
        "read a.txt", model="openai:fake-live", metadata={"workspace": str(workspace)}
    )
    internal = re.compile(r"\b\d+\.\d+\.\d+\b")
    try:
        open_task(browser, console, task_id)
        retry(lambda: "read_file" in text_of(browser, "#live-args"), timeout=90)
        assert not held.release.is_set()
        below = "return !!(document.querySelector('[data-region=header]')"
        below += ".compareDocumentPosition(document.getElementById('live-model'))"
        below += " & Node.DOCUMENT_POSITION_FOLLOWING)"
        assert browser.execute_script(below)
        line = text_of(browser, "#live-call")
        assert line == "turn 0: openai:fake-live is writing", line  # as the header and rows say
        assert text_of(browser, "#live-args").startswith("read_file {")
        assert not internal.search(text_of(browser, "#live-model")), text_of(browser, "#live-model")
        screenshot(browser, screenshots, "live-model-below-header")
    finally:
        held.release.set()
    assert charlie.wait(task_id, timeout=90).status is TaskStatus.SUCCEEDED
    retry(lambda: css(browser, "#live-model").get_attribute("data-finished") == "true", timeout=60)
    assert text_of(browser, "#live-call").endswith("wrote its answer · the task finished")
    assert not internal.search(text_of(browser, "#live-model"))

    open_task(browser, console, task_id)  # the page of a finished task
    assert browser.find_elements("css selector", "#live-model") == []
    first = "return document.querySelector('main section, main [data-live] section').outerHTML"
    assert 'data-region="header"' in browser.execute_script(first)
    screenshot(browser, screenshots, "finished-task-no-live-panel")
