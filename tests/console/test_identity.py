"""The console says how each action arrived (I32): its own, signed in with its token, apart
from a Celery message that only claims the console's operator name; the names are escaped."""

from __future__ import annotations

import html
import re
import uuid

import pytest

import charlie
from charlie.app import app
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.console.conftest import OPERATOR, Console
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(180)

HOSTILE = '<img src=x onerror="alert(1)">mallory'


def test_the_console_tells_its_signed_in_actions_from_claimed_ones(
    console: Console, cluster: Cluster, script
) -> None:  # type: ignore[no-untyped-def]
    """Call ``a`` approved from the console's form (a signed-in session); call ``b`` approved
    and ``c`` denied by Celery messages naming ``ui:tester``, the console's own actor; a
    message sent by ``charlie.send`` under a hostile name: the task page (actions, the
    transcript's rows), the result shown after the form and the JSON API say
    ``tester (console, signed in)`` for the first and ``ui:tester (claimed, via celery)`` for
    the others; the hostile name shows literally."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": k, "name": "approved_write", "arguments": {"key": f"ident-{k}"}}
                    for k in ("a", "b", "c")
                ]
            },
            {"say": "written", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("who approved", model=model, task_id=f"ui-{uuid.uuid4().hex[:12]}")
    wait_for(lambda: len(charlie.get_task(task_id).waiting_for) == 3, timeout=60)
    app.send_task("charlie.send", args=[task_id, "hello"], kwargs={"operator": HOSTILE})
    claim = {"operator": f"ui:{OPERATOR}"}
    app.send_task("charlie.approve", args=[task_id, "b"], kwargs=claim)
    app.send_task("charlie.deny", args=[task_id, "c", "no"], kwargs=claim)
    wait_for(lambda: len(charlie.actions(task_id)) == 3, timeout=60)

    with console.session() as http:
        page = http.get(f"/tasks/{task_id}").text
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page)
        assert xsrf is not None
        done = http.post(f"/tasks/{task_id}/approve", data={"call_id": "a", "_xsrf": xsrf.group(1)})
        assert done.status_code == 303
        after = http.get(f"/tasks/{task_id}").text
        assert f"{OPERATOR} (console, signed in) approved call a" in html.unescape(after)
        assert charlie.wait(task_id, timeout=90).status is TaskStatus.SUCCEEDED
        page = http.get(f"/tasks/{task_id}").text
        actions = http.get(f"/api/tasks/{task_id}/actions").json()

    shown = html.unescape(page)
    assert f"{OPERATOR} (console, signed in)" in shown
    assert f"ui:{OPERATOR} (claimed, via celery)" in shown
    assert f"message from {HOSTILE} (claimed, via celery)" in shown  # the transcript's row
    assert f"denied by ui:{OPERATOR} (claimed, via celery)" in shown  # the call's row
    assert "<img src=x" not in page  # escaped, never markup
    how = {
        (a["action"], a["call_id"]): (a["actor"], a["channel"], a["authenticated"]) for a in actions
    }
    assert how == {
        ("send", None): (HOSTILE, "celery", False),
        ("approve", "b"): (f"ui:{OPERATOR}", "celery", False),
        ("deny", "c"): (f"ui:{OPERATOR}", "celery", False),
        ("approve", "a"): (f"ui:{OPERATOR}", "ui", True),
    }


def test_a_denied_calls_result_names_who_denied_it_as_every_other_place_does(
    console: Console, cluster: Cluster, script
) -> None:  # type: ignore[no-untyped-def]
    """Call ``s`` denied from the console's form (signed in), ``c`` by a Celery message that
    claims the console's name: the result the model reads (``denied_by``), the call's badge,
    the stream's verdict event and the record's ``by`` all say the same thing; the action's
    record keeps the raw principal with its channel (I32, I27)."""
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": k, "name": "approved_write", "arguments": {"key": f"who-{k}"}}
                    for k in ("s", "c")
                ]
            },
            {"say": "as you say", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("deny both", model=model, task_id=f"ui-{uuid.uuid4().hex[:12]}")
    wait_for(lambda: len(charlie.get_task(task_id).waiting_for) == 2, timeout=60)
    app.send_task("charlie.deny", args=[task_id, "c", "no"], kwargs={"operator": f"ui:{OPERATOR}"})
    wait_for(lambda: len(charlie.actions(task_id)) == 1, timeout=60)
    with console.session() as http:
        page = http.get(f"/tasks/{task_id}").text
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page)
        assert xsrf is not None
        form = {"call_id": "s", "reason": "not now", "_xsrf": xsrf.group(1)}
        assert http.post(f"/tasks/{task_id}/deny", data=form).status_code == 303
        assert charlie.wait(task_id, timeout=90).status is TaskStatus.SUCCEEDED
        page = html.unescape(http.get(f"/tasks/{task_id}").text)
        turns = {c.call_id: c.turn for c in charlie.calls(task_id)}
        full = {
            k: html.unescape(http.get(f"/live/tasks/{task_id}/calls/{turns[k]}/{k}").text)
            for k in "sc"
        }

    signed_in = f"{OPERATOR} (console, signed in)"
    claimed = f"ui:{OPERATOR} (claimed, via celery)"
    results = {c.call_id: c.result for c in charlie.calls(task_id)}
    assert results["s"] == {"reason": "not now", "denied_by": signed_in}
    assert results["c"] == {"reason": "no", "denied_by": claimed}
    by_call = {a.call_id: a for a in charlie.actions(task_id)}
    assert [(by_call[k].actor, by_call[k].by) for k in "sc"] == [
        (f"ui:{OPERATOR}", signed_in),  # the record keeps the principal; it is shown as one
        (f"ui:{OPERATOR}", claimed),
    ]
    assert f"denied by {signed_in}" in page and f"denied by {claimed}" in page
    assert f"acting as <strong>{signed_in}</strong>" in page  # who the page acts as, the same
    assert f'"denied_by": "{signed_in}"' in full["s"] and f'"denied_by": "{claimed}"' in full["c"]
    assert f'"denied_by": "ui:{OPERATOR}"' not in page + full["s"] + full["c"]  # never the raw one
    verdicts = {
        e.data["call_id"]: e.data["by"] for e in charlie.events(task_id) if e.type == "verdict"
    }
    assert verdicts == {"s": signed_in, "c": claimed}
