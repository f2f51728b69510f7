"""The task page offers the task's record as a case file for `charlie replay` (I35): a download
of what `charlie export` writes, to the token's holder only, secrets blanked."""

from __future__ import annotations

import json
import uuid

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.replay.case import check_case
from tests.console.conftest import Console
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def test_the_task_page_links_its_export(console: Console, cluster: Cluster, script) -> None:  # type: ignore[no-untyped-def]
    model, _ = script(
        [
            {"tool_calls": [{"id": "r", "name": "echo_number", "arguments": {"value": 3}}]},
            {"say": "three", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("export me", model=model, task_id=f"ui-{uuid.uuid4().hex[:12]}")
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
    with console.session() as http:
        page = http.get(f"/tasks/{task_id}")
        assert page.status_code == 200
        assert f'href="/api/tasks/{task_id}/export"' in page.text and 'id="export"' in page.text
        got = http.get(f"/api/tasks/{task_id}/export")
    assert got.status_code == 200, got.text
    assert got.headers["content-disposition"] == f'attachment; filename="{task_id}.case.json"'
    case = check_case(json.loads(got.text))
    assert case["task"]["id"] == task_id
    assert [c["call_id"] for c in case["calls"]] == ["r"]
    with console.client() as anonymous:
        assert anonymous.get(f"/api/tasks/{task_id}/export").status_code == 401
    with console.bearer() as http:
        assert http.get("/api/tasks/no-such-task/export").status_code == 404
