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
