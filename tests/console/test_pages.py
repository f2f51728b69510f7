"""The console in a real browser (headless Chromium through Selenium) against real workers:
the rows of a run with every kind of call, the people's actions clicked on its page and
checked in the database through the API, live updates without a reload, attacker-controlled
text kept inert, and the task list's search, filters and pages."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

import charlie
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.console.conftest import OPERATOR, Console, screenshot
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.timeout(240)]

ACTOR = f"ui:{OPERATOR}"
#: how the console's own actions are shown: its operator, signed in with its token (I32)
SIGNED_IN = f"{OPERATOR} (console, signed in)"


def tid(prefix: str = "ui") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def ledger_for(task_id: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e.get("event") == event]


# -- driving a page that changes under the driver -------------------------------------------


def retry(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``fn()`` until it returns something truthy; the page swaps regions while it runs, so an
    element found a moment ago may be gone: look again."""
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        NoSuchElementException,
        StaleElementReferenceException,
    )

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except (
            StaleElementReferenceException,
            NoSuchElementException,
            ElementClickInterceptedException,
        ) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"not so within {timeout} s (last error: {last})")


def css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def css_all(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def text_of(driver: Any, selector: str) -> str:
    return str(retry(lambda: css(driver, selector).get_attribute("textContent") or " "))


def badge(driver: Any, call_id: str) -> str:
    return text_of(driver, f'details.call[data-call="{call_id}"] summary .badge').strip()


def open_task(driver: Any, console: Console, task_id: str) -> None:
    driver.get(console.url(f"/tasks/{task_id}"))
    retry(lambda: css(driver, "#status"))


def submit_form(driver: Any, form: str, fields: dict[str, str], button: str = "button") -> None:
    """Fill a form of the page and press its button (one action, as a person would)."""

    def go() -> bool:
        element = css(driver, f'form[data-key="{form}"]')
        for name, value in fields.items():
            field = element.find_element("css selector", f'[name="{name}"]')
            if field.tag_name == "select":
                from selenium.webdriver.support.ui import Select

                Select(field).select_by_value(value)
            else:
                field.clear()
                field.send_keys(value)
        element.find_element("css selector", button).click()
        return True

    before = driver.current_url.split("#")[0]
    driver.execute_script("window.__beforeSubmit = 1;")
    retry(go)
    # the post redirects back to the page (a new one), which shows the result
    retry(
        lambda: (
            driver.execute_script("return typeof window.__beforeSubmit") == "undefined"
            and css(driver, "#result")
        )
    )
    assert driver.current_url.split("#")[0] == before


def flash(driver: Any) -> str:
    return " ".join(text_of(driver, "#result").split())


def said(record: Any, did: str, rest: str = "") -> str:
    """The one sentence a page shows after an action: who did what, when."""
    return f"{record.by} {did} at {record.at.isoformat(timespec='seconds')}{rest}."


def action_of(task_id: str, action: str, call_id: str | None = None) -> Any:
    (record,) = [
        a
        for a in charlie.actions(task_id)
        if a.action.value == action and (call_id is None or a.call_id == call_id)
    ]
    return record


# -- a run with every kind of call ------------------------------------------------------------


def test_a_run_with_every_kind_of_call_and_the_people_who_decide_it(
    console: Console, browser: Any, cluster: Cluster, script, screenshots: Path
) -> None:
    """One run: a call ok and one in error; a read whose worker is SIGKILLed (interrupted);
    a held_write whose worker is SIGKILLed (held for a verdict, reconciled `done` in the
    browser); two approved_writes (approve one, deny the other, in the browser); a question
    (answered in the browser). Each click is checked in the database through the API."""
    key = f"hw-{uuid.uuid4().hex[:6]}"
    model, _ = script(
        [
            {
                "say": "First a look around.",
                "tool_calls": [
                    {
                        "id": "ok1",
                        "name": "sleep_then",
                        "arguments": {"seconds": 0.1, "value": "all fine"},
                    },
                    {"id": "err1", "name": "boom", "arguments": {"message": "the disk is full"}},
                ],
            },
            {
                "tool_calls": [
                    {
                        "id": "slow",
                        "name": "sleep_then",
                        "arguments": {"seconds": 50, "value": "never"},
                    }
                ]
            },
            {
                "expect": {"tool_results": [{"call_id": "slow", "outcome": "interrupted"}]},
                "say": "That read was interrupted; writing the record now.",
                "tool_calls": [
                    {"id": "hw", "name": "held_write", "arguments": {"key": key, "hold": 50}}
                ],
            },
            {
                "expect": {
                    "tool_results": [{"call_id": "hw", "outcome": "ok", "contains": "by hand"}]
                },
                "tool_calls": [
                    {"id": "ap1", "name": "approved_write", "arguments": {"key": f"{key}-a"}},
                    {"id": "ap2", "name": "approved_write", "arguments": {"key": f"{key}-b"}},
                ],
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "ap1", "outcome": "ok"},
                        {"call_id": "ap2", "outcome": "denied", "contains": "not today"},
                    ]
                },
                "tool_calls": [
                    {"id": "q", "name": "ask_human", "arguments": {"question": "Which branch?"}}
                ],
            },
            {
                "expect": {"tool_results": [{"call_id": "q", "outcome": "ok", "contains": "main"}]},
                "say": "Done on main.",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("A run with every kind of call", model=model, task_id=tid("story"))
    open_task(browser, console, task_id)

    # the read of turn 1 runs: kill its worker; the sweep settles it interrupted
    (start,) = wait_for(lambda: ledger_for(task_id, "sleep_then.start")[1:], timeout=60)
    cluster.kill_pid_group(int(start["pid"]))
    # the held write of turn 2 runs: kill its worker; it is held for a verdict
    (write,) = wait_for(lambda: ledger_for(task_id, "held_write"), timeout=90)
    cluster.kill_pid_group(int(write["pid"]))
    wait_for(lambda: charlie.get_task(task_id).waiting_for, timeout=60)

    # the page followed all of it live: the rows and the held call are there without a reload
    retry(lambda: badge(browser, "slow") == "interrupted", timeout=30)
    # in a sentence, not its evidence's JSON (which is one click away, in the opened row)
    lost = 'details.call[data-call="slow"] .result-short'
    retry(lambda: "cannot tell whether it took effect" in text_of(browser, lost), timeout=30)
    (slow,) = [c for c in charlie.calls(task_id) if c.call_id == "slow"]
    assert f"started by {slow.started_by} at " in text_of(browser, lost)
    assert "{" not in text_of(browser, lost)
    # a recovered call says so beside its outcome (I36)
    slow_badge = 'details.call[data-call="slow"] .badge.recovered'
    retry(lambda: text_of(browser, slow_badge).strip() == "recovered: interrupted")
    assert badge(browser, "ok1") == "ok"
    assert badge(browser, "err1") == "error"
    assert "the disk is full" in text_of(browser, 'details.call[data-call="err1"]')
    retry(lambda: "held: interrupted" in text_of(browser, '.open-call[data-call="hw"]'))
    held = text_of(browser, '.open-call[data-call="hw"]')
    assert "evidence of the interruption" in held
    # in words, what the person is asked to decide and why
    (hw,) = [c for c in charlie.calls(task_id) if c.call_id == "hw"]
    assert f"started by {hw.started_by}, its worker stopped before a result was recorded" in held
    assert "whether it took effect is unknown" in held
    # held, it has no deadline: the line says what it waits for, not "deadline -"
    assert "no deadline: waits for a verdict" in held and "deadline -" not in held
    assert "a reconcile verdict on hw" in text_of(browser, "#waiting-for")
    assert css_all(browser, "svg#timeline path.kill")  # the interrupted call, on its worker's lane
    lanes = [t.text for t in css_all(browser, "svg#timeline text.lane-label")]
    assert lanes[0] == "run" and len(lanes) >= 3
    screenshot(browser, screenshots, "task-interrupted-and-held")

    # the reconcile verdict, clicked
    result = json.dumps({"written": key, "checked": "by hand"})
    submit_form(
        browser,
        "reconcile-hw",
        {"note": "the row is in the ledger", "result": result},
        'button[value="done"]',
    )
    # one sentence, not "reconcile done: reconcile done by ..."
    reconciled = action_of(task_id, "reconcile", "hw")
    assert flash(browser) == said(reconciled, "reconciled call hw as done")
    call = {c.call_id: c for c in charlie.calls(task_id)}["hw"]
    assert call.outcome == "ok" and call.result == {"written": key, "checked": "by hand"}
    # its row says who settled it, and its run time apart from the time it was held
    ran = datetime.fromisoformat(call.hold_info["held_at"]) - call.started_at
    waited = call.settled_at - datetime.fromisoformat(call.hold_info["held_at"])
    assert waited.total_seconds() > 0  # it sat held while the page was read and the form sent
    assert ran.total_seconds() >= 0
    row = 'details.call[data-call="hw"] summary'
    retry(lambda: "reconciled by" in text_of(browser, f"{row} .worker"), timeout=30)
    worker = text_of(browser, f"{row} .worker").strip()
    assert worker == f"{call.started_by} · reconciled by {SIGNED_IN}"
    dur = text_of(browser, f"{row} .dur").strip()
    assert dur.startswith(f"{ran.total_seconds():.1f} s, held "), (dur, ran, waited)
    hw_badge = 'details.call[data-call="hw"] .badge.recovered'
    retry(lambda: text_of(browser, hw_badge).strip() == "recovered: decided by a person")
    assert dur != f"{(call.settled_at - call.started_at).total_seconds():.1f} s"

    # two approvals arrive live; approve one, deny the other
    retry(lambda: css(browser, 'form[data-key="approve-ap1"]'), timeout=60)
    retry(lambda: css(browser, 'form[data-key="deny-ap2"]'), timeout=30)
    assert "no deadline yet: it counts from the approve" in text_of(
        browser, '.open-call[data-call="ap1"]'
    )
    # the live panel names the model as the header does (a scripted model by its file's name)
    # and says the model's call ended, never "completed" while the run waits for people
    line = f"turn 3: {text_of(browser, '#model')} wrote its tool calls"
    retry(lambda: text_of(browser, "#live-call") == line, timeout=30)
    assert "scripted:…/" in line
    screenshot(browser, screenshots, "task-awaiting-approval")
    submit_form(browser, "approve-ap1", {"note": "looks right"}, "button.approve")
    assert flash(browser) == said(action_of(task_id, "approve"), "approved call ap1")
    submit_form(browser, "deny-ap2", {"reason": "not today"}, "button.deny")
    assert flash(browser) == said(action_of(task_id, "deny"), "denied call ap2")

    # the question arrives live; answer it
    retry(lambda: css(browser, 'form[data-key="reply-q"]'), timeout=60)
    assert "Which branch?" in text_of(browser, '.open-call[data-call="q"]')
    submit_form(browser, "reply-q", {"text": "main"}, "button.reply")
    assert flash(browser) == said(action_of(task_id, "reply"), "answered call q")

    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    calls = {c.call_id: c for c in charlie.calls(task_id)}
    assert (calls["ap1"].outcome, calls["ap2"].outcome, calls["q"].outcome) == (
        "ok",
        "denied",
        "ok",
    )
    assert len(ledger_for(task_id, "approved_write")) == 1  # the denied one never ran
    assert calls["q"].result == "main"
    done = [(a.action.value, a.call_id, a.actor) for a in charlie.actions(task_id)]
    assert done == [
        ("reconcile", "hw", ACTOR),
        ("approve", "ap1", ACTOR),
        ("deny", "ap2", ACTOR),
        ("reply", "q", ACTOR),
    ]
    # the finished run, live: the final answer row and every outcome
    retry(lambda: "Done on main." in text_of(browser, ".row.kind-final"), timeout=30)
    assert badge(browser, "ap2") == "denied"
    # a person's verdict is shown as theirs: no worker, and no "operator:" before "ui:"
    retry(lambda: "answered by" in text_of(browser, 'details.call[data-call="q"] .worker'))
    assert text_of(browser, 'details.call[data-call="ap2"] .worker').strip() == (
        f"denied by {SIGNED_IN}"
    )
    assert text_of(browser, 'details.call[data-call="q"] .worker').strip() == (
        f"answered by {SIGNED_IN}"
    )
    assert "operator:" not in text_of(browser, "#transcript")
    assert retry(lambda: text_of(browser, "#status").strip() == "succeeded")
    log = text_of(browser, ".actions-log")
    assert f"reconcile done by {SIGNED_IN}" in log and f"deny by {SIGNED_IN}" in log
    screenshot(browser, screenshots, "task-finished")


def test_a_row_appears_live_without_a_reload(
    console: Console, browser: Any, cluster: Cluster, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "first",
                        "name": "sleep_then",
                        "arguments": {"seconds": 2, "value": "one"},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "id": "second",
                        "name": "sleep_then",
                        "arguments": {"seconds": 2, "value": "two"},
                    }
                ]
            },
            {"say": "both done", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("live rows", model=model, task_id=tid("live"))
    open_task(browser, console, task_id)
    browser.execute_script("window.__samePage = 'yes';")
    assert not css_all(browser, 'details.call[data-call="second"]')
    retry(lambda: css(browser, 'details.call[data-call="first"]'), timeout=30)
    retry(lambda: badge(browser, "second") in ("started", "ok"), timeout=30)
    retry(lambda: badge(browser, "second") == "ok", timeout=30)
    retry(lambda: "both done" in text_of(browser, ".row.kind-final"), timeout=30)
    assert browser.execute_script("return window.__samePage") == "yes"  # never reloaded
    # The final answer is committed one step before the task is marked succeeded (the
    # report_terminal tick): the status follows on a later poll, still without a reload.
    retry(lambda: text_of(browser, "#status").strip() == "succeeded", timeout=30)
    assert browser.execute_script("return window.__samePage") == "yes"


def test_send_and_cancel_from_the_page(
    console: Console, browser: Any, cluster: Cluster, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "s", "name": "sleep_then", "arguments": {"seconds": 6, "value": "v"}}
                ]
            },
            {
                "expect": {"contains": ["also check the logs"]},
                "tool_calls": [
                    {"id": "long", "name": "sleep_then", "arguments": {"seconds": 40, "value": "w"}}
                ],
            },
            {"say": "never", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("send then cancel", model=model, task_id=tid("send"))
    wait_for(lambda: ledger_for(task_id, "sleep_then.start"), timeout=30)
    open_task(browser, console, task_id)
    submit_form(browser, "send", {"text": "please also check the logs"}, "button.send")
    (sent,) = [a for a in charlie.actions(task_id) if a.action.value == "send"]
    assert flash(browser) == said(
        sent,
        f"sent message {sent.detail['message_id']}",
        "; it enters at the next turn boundary",
    )
    assert sent.actor == ACTOR
    # the message enters at the turn boundary: its row appears live
    retry(lambda: "also check the logs" in text_of(browser, ".row.kind-message"), timeout=30)
    assert f"message from {SIGNED_IN}" in text_of(browser, ".row.kind-message")
    wait_for(lambda: len(ledger_for(task_id, "sleep_then.start")) == 2, timeout=30)
    retry(lambda: badge(browser, "long") == "started", timeout=30)
    # its dispatch state among the open calls: who started it, the lease, the deadline
    (started,) = [c for c in charlie.calls(task_id) if c.call_id == "long"]
    open_call = retry(lambda: text_of(browser, '.open-call[data-call="long"]'))
    assert f"started by {started.started_by}, lease held by {started.lease_owner}" in open_call
    assert "lease until 20" in open_call and f"deadline {started.deadline_at:%Y-%m-%d}" in open_call
    submit_form(browser, "cancel", {"note": "wrong task"}, "button.cancel")
    assert flash(browser) == said(action_of(task_id, "cancel"), "canceled the task")
    info = charlie.get_task(task_id)
    assert info.status is TaskStatus.CANCELED
    (record,) = [a for a in charlie.actions(task_id) if a.action.value == "cancel"]
    assert record.actor == ACTOR and record.note == "wrong task"
    retry(lambda: badge(browser, "long") == "canceled", timeout=30)
    assert not css_all(browser, 'form[data-key="cancel"]')  # nothing more to cancel


def test_resume_and_fork_from_the_page(
    console: Console, browser: Any, cluster: Cluster, script, tmp_path: Path, screenshots: Path
) -> None:
    fault = tmp_path / "model-is-down"
    fault.write_text("")
    model, _ = script(
        [
            {"tool_calls": [{"id": "a", "name": "ledger_write", "arguments": {"key": "once"}}]},
            {
                "raise": "the model is down",
                "raise_while": str(fault),
                "say": "recovered",
                "tool_calls": [],
            },
        ]
    )
    task_id = charlie.submit("resume and fork", model=model, task_id=tid("resume"))
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.FAILED
    wait_for(lambda: charlie.get_task(task_id).phase.value == "done", timeout=30)
    open_task(browser, console, task_id)
    assert "the model is down" in text_of(browser, ".error-box")
    fault.unlink()
    submit_form(browser, "resume", {"note": "the model is back"}, "button.resume")
    assert flash(browser) == said(action_of(task_id, "resume"), "resumed the task")
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    (resumed,) = [a for a in charlie.actions(task_id) if a.action.value == "resume"]
    assert resumed.actor == ACTOR and resumed.detail["phase"] == "call_model"
    retry(lambda: "recovered" in text_of(browser, ".row.kind-final"), timeout=30)
    # the resume's transition is the person's, in the people lane: no lane named like a worker
    # called operator:ui:NAME
    open_task(browser, console, task_id)
    lanes = [t.text for t in css_all(browser, "svg#timeline text.lane-label")]
    assert "people" in lanes, lanes
    assert not [name for name in lanes if name.startswith("operator")], lanes

    retry(lambda: css(browser, 'form[data-key="fork"]'))
    submit_form(browser, "fork", {"turn": "0", "message": "try it another way"}, "button.fork")
    link = css(browser, "#result-link")
    fork_id = link.text.removeprefix("open ").strip()
    (forked,) = [a for a in charlie.actions(task_id) if a.action.value == "fork"]
    assert flash(browser) == said(forked, "forked the task", f" into new task {fork_id}") + (
        f" — open {fork_id}"
    )
    assert forked.detail["fork"] == fork_id and forked.actor == ACTOR
    link.click()
    retry(lambda: fork_id in text_of(browser, ".task-id"))
    assert charlie.wait(fork_id, timeout=60).status is TaskStatus.SUCCEEDED
    retry(lambda: "copied from" in text_of(browser, "#transcript"), timeout=30)
    retry(lambda: "try it another way" in text_of(browser, ".row.kind-message"), timeout=30)
    assert len(ledger_for(task_id, "write")) == 1 and not ledger_for(fork_id, "write")


def test_a_family_a_deadline_and_a_late_report(
    console: Console, browser: Any, cluster: Cluster, script, tmp_path: Path
) -> None:
    """The header links a parent to its child and back; a parked wait settles `deadline
    exceeded` at its deadline, and the late report of its outside work appears beside that
    outcome, live, after the run has finished."""
    done_file = tmp_path / "outside-work.done"
    child_model, _ = script([{"say": "compatible", "sleep": 2}])
    model, _ = script(
        [
            {
                "tool_calls": [
                    {
                        "id": "d1",
                        "name": "delegate",
                        "arguments": {"prompt": "check compatibility", "model": child_model},
                    },
                    {"id": "w", "name": "wait_for_file", "arguments": {"path": str(done_file)}},
                ]
            },
            {
                "tool_calls": [
                    {
                        "id": "w1",
                        "name": "wait_for_task",
                        "arguments": {"task_id": "{task_id}.0.d1"},
                    }
                ]
            },
            {"say": "The child says it is compatible.", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("a family", model=model, task_id=tid("family"))
    child = f"{task_id}.0.d1"
    open_task(browser, console, task_id)
    browser.execute_script("window.__samePage = 'yes';")
    retry(lambda: badge(browser, "w") == "deadline exceeded", timeout=30)
    retry(lambda: "succeeded" in text_of(browser, "#status"), timeout=60)
    assert badge(browser, "d1") == "ok" and badge(browser, "w1") == "ok"
    assert text_of(browser, 'details.call[data-call="w"] .worker').strip() != "-"
    children = retry(lambda: css_all(browser, ".facts .child a"))
    assert [a.text for a in children] == [child]
    assert "succeeded" in text_of(browser, ".facts .child .badge")
    assert not css_all(browser, 'details.call[data-call="w"] .badge.late')

    # the outside work ends after the deadline: its late report, beside the outcome, live
    done_file.write_text("finished after the deadline")
    late = retry(
        lambda: text_of(browser, 'details.call[data-call="w"] .badge.late').strip(), timeout=40
    )
    assert late == "late report: ok, finished after the deadline"
    assert badge(browser, "w") == "deadline exceeded"  # the first outcome stands (I12)
    assert browser.execute_script("return window.__samePage") == "yes"
    css(browser, 'details.call[data-call="w"] summary').click()
    # the opened row loads the call's whole record: its late report and its deadline
    full = 'details.call[data-call="w"] .full'
    retry(lambda: "late reports" in text_of(browser, full))
    assert "finished after the deadline" in text_of(browser, full)
    assert "deadline" in text_of(browser, full)

    css(browser, ".facts .child a").click()
    retry(lambda: child in text_of(browser, ".task-id"))
    parent = css(browser, ".facts dd a")
    assert parent.text == task_id and parent.get_attribute("href").endswith(f"/tasks/{task_id}")


PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=1">'


def test_attacker_controlled_text_stays_inert(
    console: Console, browser: Any, cluster: Cluster, script
) -> None:
    """Tool output and prompts are attacker-controlled: escaped everywhere, shown literally."""
    model, _ = script(
        [
            {
                "say": PAYLOAD,
                "tool_calls": [
                    {
                        "id": "x",
                        "name": "sleep_then",
                        "arguments": {"seconds": 0, "value": PAYLOAD},
                    },
                    {"id": "y", "name": "boom", "arguments": {"message": PAYLOAD}},
                ],
            },
            {"say": f"final {PAYLOAD}", "tool_calls": []},
        ]
    )
    task_id = charlie.submit(f"xss {PAYLOAD}", model=model, task_id=tid("xss"))
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    # the server's HTML carries it escaped only
    with console.session() as http:
        for path in (f"/tasks/{task_id}", f"/live/tasks/{task_id}", f"/?q={task_id}"):
            html = http.get(path).text
            assert "<script>window.__pwned" not in html and "<img src=x" not in html, path
            assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html, path

    browser.get(console.url(f"/?q={task_id}"))
    retry(lambda: css(browser, f'tr[data-key="{task_id}"]'))
    assert PAYLOAD in text_of(browser, f'tr[data-key="{task_id}"] .prompt')
    assert browser.execute_script("return typeof window.__pwned") == "undefined"

    open_task(browser, console, task_id)
    retry(lambda: badge(browser, "x") == "ok")
    css(browser, 'details.call[data-call="x"] summary').click()
    assert (
        text_of(browser, 'details.call[data-call="x"] pre.arguments').count("window.__pwned") == 2
    )
    assert text_of(browser, 'details.call[data-call="x"] pre.result') == PAYLOAD
    # an error's result is JSON: its quotes are escaped there, its tags shown as they are
    assert "<script>window.__pwned=1</script>" in text_of(browser, 'details.call[data-call="y"]')
    assert PAYLOAD in text_of(browser, ".row.kind-user")
    assert f"final {PAYLOAD}" in text_of(browser, ".row.kind-final")
    assert not css_all(browser, "#transcript img") and not css_all(browser, "#transcript script")
    time.sleep(1.5)  # a live poll or two: swapped fragments stay inert as well
    assert browser.execute_script("return typeof window.__pwned") == "undefined"


def test_the_list_searches_filters_pages_and_updates_live(
    console: Console, browser: Any, cluster: Cluster, script, screenshots: Path
) -> None:
    marker = uuid.uuid4().hex[:8]
    quick, _ = script([{"say": "done", "tool_calls": []}])
    broken, _ = script([{"raise": "the model refused", "say": "x", "tool_calls": []}])
    slow, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "s", "name": "sleep_then", "arguments": {"seconds": 20, "value": "v"}}
                ]
            },
            {"say": "slept", "tool_calls": []},
        ]
    )
    asks, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "q", "name": "ask_human", "arguments": {"question": "Ship it?"}}
                ]
            },
            {"say": "ok", "tool_calls": []},
        ]
    )
    made = []
    for n, (what, model) in enumerate(
        [("number 0", quick), ("number 1", quick), ("fails", broken), ("canceled", slow),
         ("runs", slow), ("asks", asks)]
    ):  # fmt: skip
        made.append(charlie.submit(f"list {marker} {what}", model=model, task_id=tid(f"list{n}")))
        time.sleep(0.02)
    charlie.cancel(made[3])
    waiting = made[5]
    wait_for(lambda: charlie.get_task(waiting).waiting_for, timeout=30)
    wait_for(lambda: charlie.get_task(made[2]).terminal, timeout=90)
    wait_for(lambda: charlie.get_task(made[4]).status is TaskStatus.RUNNING, timeout=30)

    browser.get(console.url(f"/?q={marker}"))
    retry(lambda: len(css_all(browser, "tr.task")) == 6)
    statuses = [t.text for t in css_all(browser, "tr.task td:nth-child(2) .badge")]
    assert statuses == ["waiting", "running", "canceled", "failed", "succeeded", "succeeded"]
    assert "a reply to q: Ship it?" in text_of(browser, f'tr[data-key="{waiting}"] .waits')
    screenshot(browser, screenshots, "task-list")

    browser.get(console.url(f"/?q={marker}&limit=2"))
    keys = lambda: [r.get_attribute("data-key") for r in css_all(browser, "tr.task")]  # noqa: E731
    assert retry(keys) == [made[5], made[4]]  # newest first, two a page
    css(browser, "#older").click()
    retry(lambda: keys() == [made[3], made[2]])
    css(browser, "#older").click()
    retry(lambda: keys() == [made[1], made[0]])
    assert css_all(browser, "#newest")

    browser.get(console.url(f"/?q={marker}"))
    retry(lambda: len(css_all(browser, "tr.task")) == 6)
    css(browser, 'input[name="status"][value="waiting"]').click()
    css(browser, 'input[name="status"][value="failed"]').click()
    css(browser, "#filter").click()
    retry(lambda: keys() == [waiting, made[2]])
    assert "status=waiting" in browser.current_url and "status=failed" in browser.current_url

    # live: a new task appears, and a status changes, without a reload
    browser.get(console.url(f"/?q={marker}"))
    retry(lambda: len(css_all(browser, "tr.task")) == 6)
    browser.execute_script("window.__samePage = 'yes';")
    late = charlie.submit(f"list {marker} late", model=quick, task_id=tid("list"))
    retry(lambda: keys()[0] == late, timeout=20)
    charlie.reply(waiting, "q", "yes")
    retry(lambda: "succeeded" in text_of(browser, f'tr[data-key="{waiting}"]'), timeout=30)
    assert browser.execute_script("return window.__samePage") == "yes"
    charlie.cancel(made[4])


def test_a_page_that_is_not_there(console: Console, browser: Any, cluster: Cluster) -> None:
    browser.get(console.url("/tasks/no-such-task"))
    assert "no task no-such-task" in text_of(browser, "body")
    with console.session() as http:
        assert http.get("/tasks/no-such-task").status_code == 404
        assert http.get("/nowhere").status_code == 404
    assert httpx.get(console.url("/nowhere")).status_code == 401


def test_a_browser_asks_for_no_favicon(console: Console, browser: Any) -> None:
    """Chromium asked every page for /favicon.ico, and each 404 was a WARNING line in the
    operator's log at the default level; the pages now name an empty icon (a data: URL, which
    the CSP's img-src allows), so no such request is made."""
    browser.get(console.url("/tasks/no-such-task"))
    assert "no task no-such-task" in text_of(browser, "body")
    time.sleep(1)  # the browser's icon request, if it made one, comes after the load
    assert "favicon" not in console.log.read_text()
