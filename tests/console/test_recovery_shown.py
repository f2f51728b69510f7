"""What a person sees when something went wrong, in a real browser against real workers: a
call whose worker was SIGKILLed and whose reconcile hook settled it carries a `recovered`
badge and a marker on the lanes of the worker that died and of the one that settled it, with
one duration for it everywhere (`charlie show` too); a task whose model call keeps failing says
it is retrying, its last error and its next attempt, on its page (header, live panel and
timeline, one count of attempts) and in the list (I36)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.models.retrying import attempts_failed
from charlie.views import call_took, transcript_rows
from tests.conftest import wait_for
from tests.console.conftest import Console, screenshot
from tests.console.test_pages import badge, css, css_all, ledger_for, open_task, retry, text_of, tid
from tests.support.cluster import Cluster
from tests.support.fake_openai import FakeOpenAI, Reply

pytestmark = [pytest.mark.timeout(240)]


def test_a_reconciled_call_shows_its_recovery(
    console: Console, browser: Any, cluster: Cluster, script, screenshots: Path
) -> None:
    key = f"rw-{uuid.uuid4().hex[:6]}"
    model, _ = script(
        [
            {
                "say": "Writing the record.",
                "tool_calls": [
                    {"id": "rw", "name": "idempotent_write", "arguments": {"key": key, "hold": 60}}
                ],
            },
            {
                "expect": {"tool_results": [{"call_id": "rw", "outcome": "ok"}]},
                "say": "Written, and found by its read-back.",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("a write whose worker dies", model=model, task_id=tid("recov"))
    (write,) = wait_for(lambda: ledger_for(task_id, "write"), timeout=60)
    cluster.kill_pid_group(int(write["pid"]))  # the write happened; its result was never recorded
    assert charlie.wait(task_id, timeout=120).status is TaskStatus.SUCCEEDED
    (call,) = [c for c in charlie.calls(task_id) if c.call_id == "rw"]
    assert call.result["reconciled"] is True and call.outcome == "ok"

    open_task(browser, console, task_id)
    row = 'details.call[data-call="rw"]'
    assert badge(browser, "rw") == "ok"
    recovered = retry(lambda: text_of(browser, f"{row} .badge.recovered").strip())
    assert recovered == "recovered: reconciled"
    why = css(browser, f"{row} .badge.recovered").get_attribute("title")
    lost = call.result["evidence"]["started_by"]
    assert f"its worker {lost} stopped" in why and "reconcile hook" in why, why
    assert text_of(browser, f"{row} .worker").strip() == f"{lost} · reconciled by {call.settled_by}"
    assert "its reconcile hook found:" in text_of(browser, f"{row} .result-short")
    # a marker on the lane of the worker that died and on the lane of the one that settled it
    marks = css_all(browser, "svg#timeline circle.recovered")
    assert len(marks) == 2, [m.get_attribute("outerHTML") for m in marks]
    lanes = {
        t.text: float(t.get_attribute("y"))
        for t in css_all(browser, "svg#timeline text.lane-label")
    }
    heights = sorted(float(m.get_attribute("cy")) for m in marks)
    assert lost != call.settled_by and heights[0] != heights[1]
    assert all(any(abs(y + 15 - cy) < 12 for y in lanes.values()) for cy in heights)
    # one duration for the call: the console's row, `charlie show`, the timeline's tooltip
    took = call_took(call)
    assert text_of(browser, f"{row} .dur").strip() == took
    shown = next(line for _, line in transcript_rows(task_id) if "idempotent_write" in line)
    assert f"[ok, {took}, reconciled]" in shown, shown
    assert took != f"{call.duration_ms:.0f} ms"  # not the reconcile hook's milliseconds
    # small words: the header's counts agree with their nouns, and the transcript's numbers
    # run without a gap to the count it gives (a call and its result share a row: "3·4")
    record = css(browser, "dl.facts").find_element(
        "xpath", ".//dt[text()='record']/following-sibling::dd"
    )
    said = record.get_attribute("textContent").strip()
    items = int(said.split()[0])
    assert said == f"{items} transcript items, 1 tool call", said
    shown = [s.get_attribute("textContent") for s in css_all(browser, "article.row .seq")]
    numbers = sorted(int(n) for s in shown for n in re.findall(r"\d+", s))
    assert numbers == list(range(items)), shown
    screenshot(browser, screenshots, "task-recovered-call")


def test_a_model_that_keeps_failing_shows_retrying(
    console: Console, browser: Any, cluster: Cluster, model_server: FakeOpenAI, screenshots: Path
) -> None:
    """I36: the page's header and its live panel give one count, the run's, and keep giving
    the same one as retries land; the error repeats no count; the timeline draws the failed
    tries and the waits after them on the worker's lane, titled with the attempts and the
    provider's error, shown as text (it is attacker-controlled)."""
    hostile = 'The server is overloaded <img src=x id=pwned onerror="document.title=1">'
    overloaded = {"error": {"message": hostile, "type": "server_error"}}
    model_server.enqueue(*[Reply(503, overloaded) for _ in range(400)])
    task_id = charlie.submit("hi", model="openai:fake-model", task_id=tid("retrying"))
    try:
        first = wait_for(lambda: charlie.get_task(task_id).retrying, timeout=60)
        open_task(browser, console, task_id)
        box = retry(lambda: text_of(browser, "#retrying"))
        assert "retrying the model call:" in box and "next attempt at" in box, box
        assert "HTTP 503" in box and hostile in box, box
        assert "gives up at" in box
        assert box.count("attempt") == 2, box  # "N attempts failed", "next attempt at"
        # a retry or more later, the header (re-rendered as the page follows the run) and the
        # live panel (from the run's events) say the run's count, in the same words
        wait_for(lambda: charlie.get_task(task_id).retrying.attempts > first.attempts, 60)

        def agreed() -> str | None:
            state = charlie.get_task(task_id).retrying
            said = attempts_failed(state.attempts) if state else "-"
            header, live = text_of(browser, "#retrying"), text_of(browser, "#live-call")
            if f"retrying the model call: {said};" in header and said in live:
                return live
            return None

        live = retry(agreed, timeout=30)
        assert "next attempt at" in live and hostile in live and live.count("attempt") == 2, live
        # the timeline: the tries and the waits on the lane of the worker that tried
        waits = retry(lambda: css_all(browser, "svg#timeline rect.retry-wait"))
        tried = css_all(browser, "svg#timeline rect.retry-tried")
        assert len(tried) == len(waits) >= 1
        lanes = {
            t.text: float(t.get_attribute("y"))
            for t in css_all(browser, "svg#timeline text.lane-label")
        }
        workers = [label_y - 15 for label, label_y in lanes.items() if label != "run"]
        for mark in [*tried, *waits]:
            top = float(mark.get_attribute("y"))
            assert any(lane < top < lane + 22 for lane in workers), (top, lanes)
        title = waits[-1].find_element("css selector", "title").get_attribute("textContent")
        assert "waiting to retry after" in title and "attempts failed" in title, title
        assert "to attempt" in title and hostile in title, title
        # shown, never obeyed: no element came of the provider's text
        assert not css_all(browser, "#pwned") and browser.title != "1"
        screenshot(browser, screenshots, "task-retrying")
        browser.get(console.url(f"/?q={task_id}"))
        listed = retry(lambda: text_of(browser, f'tr[data-key="{task_id}"] .waiting.retrying'))
        assert listed.startswith("retrying its model call:"), listed
        assert not css_all(browser, "#pwned")
        # the workers' table counts in words that agree with the number ("1 task")
        pools = [r.text for r in css_all(browser, "table.pools tr.pool")]
        assert not [r for r in pools if re.search(r"\b1 (tasks|model calls)\b", r)], pools
        screenshot(browser, screenshots, "task-list-retrying")
    finally:
        charlie.cancel(task_id)
        model_server.reset()
