"""The console over plain HTTP: nothing without the token, a session cookie after ?token=,
Bearer on /api, forged form posts refused; the JSON API's shapes and its action errors."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

import charlie
from charlie.domain import TaskStatus
from tests.conftest import wait_for
from tests.console.conftest import OPERATOR, Console, stop_console
from tests.support.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(120)


def tid() -> str:
    return f"ui-{uuid.uuid4().hex[:12]}"


def held_for_approval(script, key: str) -> str:  # type: ignore[no-untyped-def]
    model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "approved_write", "arguments": {"key": key}}]},
            {"say": "written", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("approve over http", model=model, task_id=tid())
    wait_for(lambda: charlie.get_task(task_id).waiting_for, timeout=30)
    return task_id


def _started_console(
    cluster: Cluster, *args: str, **env: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`charlie ui --port 0 ARGS` and the address it printed (its ``http://`` line)."""
    environment = {**cluster.env, **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "charlie", "ui", "--port", "0", *args],
        env=environment,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    printed = b""
    deadline = time.monotonic() + 60
    while b"http://" not in printed or not printed.endswith(b"\n"):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"charlie ui printed no address: {printed.decode()}")
        if select.select([proc.stdout], [], [], 0.5)[0]:
            printed += os.read(proc.stdout.fileno(), 4096)
    (address,) = re.findall(r"^\s+(http://\S+)", printed.decode(), re.M)
    return proc, address


def test_without_a_token_one_is_generated_and_the_whole_address_printed(
    cluster: Cluster,
) -> None:
    """No --token and no CHARLIE_UI_TOKEN: a new token; its URL (with the token where stdout
    is a terminal, test_hardening; here a pipe: the token in a file) opens the page it names,
    and nothing else gets in."""
    proc, address = _started_console(cluster, "--task", "some-task")
    try:
        match = re.fullmatch(r"(http://127\.0\.0\.1:(\d+))/tasks/some-task\?token=<the", address)
        assert match, address
        base, port = match.groups()
        token = (Path(cluster.env["CHARLIE_HOME"]) / f"ui-token-{port}").read_text().strip()
        assert len(token) >= 32
        address = f"{base}/tasks/some-task?token={token}"
        with httpx.Client(base_url=base, follow_redirects=False, timeout=30) as http:
            assert http.get("/").status_code == 401
            first = http.get(address.removeprefix(base))
            assert first.status_code == 303 and first.headers["location"] == "/tasks/some-task"
            assert http.get("/").status_code == 200  # the session cookie
        bearer = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{base}/api/tasks", headers=bearer).status_code == 200
    finally:
        stop_console(proc)
    # a second console generates another token: the first one's sessions do not carry over
    again, other = _started_console(cluster)
    try:
        assert token not in other
    finally:
        stop_console(again)


def test_the_token_from_charlie_ui_token_is_not_printed(cluster: Cluster) -> None:
    token = f"from-the-environment-{uuid.uuid4().hex}"
    proc, address = _started_console(cluster, CHARLIE_UI_TOKEN=token)
    try:
        assert token not in address and address.endswith("?token=<the")
        base = address.split("/?")[0]
        assert httpx.get(f"{base}/api/tasks").status_code == 401
        ok = httpx.get(f"{base}/api/tasks", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and "tasks" in ok.json()
        wrong = {"Authorization": f"Bearer {token}x"}
        assert httpx.get(f"{base}/api/tasks", headers=wrong).status_code == 401
    finally:
        stop_console(proc)
    short = subprocess.run(
        [sys.executable, "-m", "charlie", "ui", "--port", "0"],
        env={**cluster.env, "CHARLIE_UI_TOKEN": "too-short"},
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    assert short.returncode != 0 and b"at least 16 characters" in short.stderr + short.stdout


def test_nothing_is_served_without_the_token(console: Console, cluster: Cluster) -> None:
    with console.client() as http:
        for path in ("/", "/tasks/anything", "/live/tasks", "/api/tasks", "/static/console.js"):
            r = http.get(path)
            assert r.status_code == 401, path
            assert "console.js" not in r.text and "<table" not in r.text
        assert http.get("/?token=wrong-token-0123456789").status_code == 401
        assert http.get("/api/tasks", headers={"Authorization": "Bearer nope"}).status_code == 401
        # ?token= is for pages: the API takes the bearer header only
        assert http.get(f"/api/tasks?token={console.token}").status_code == 401
        assert (
            http.get("/api/tasks", headers={"Authorization": f"Basic {console.token}"}).status_code
            == 401
        )


def test_a_token_once_then_a_session_cookie(console: Console, cluster: Cluster) -> None:
    with console.client() as http:
        first = http.get(f"/tasks/x?token={console.token}&keep=1")
        assert first.status_code == 303
        assert first.headers["location"] == "/tasks/x?keep=1"  # the token leaves the address
        cookie = first.headers["set-cookie"]
        assert "charlie_ui=" in cookie and "HttpOnly" in cookie and "SameSite=Lax" in cookie
        assert console.token not in cookie
        page = http.get("/")
        assert page.status_code == 200 and "<table" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        assert page.headers["x-frame-options"] == "DENY"
        assert http.get("/static/console.js").status_code == 200
        # the session works for the page's own reads too (its live poll)
        assert http.get("/api/tasks").status_code == 200


def test_the_api_takes_a_bearer_token_and_returns_the_python_apis_shapes(
    console: Console, cluster: Cluster, script
) -> None:
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "sleep_then", "arguments": {"seconds": 0, "value": "x"}}
                ]
            },
            {"say": "done", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("shapes", model=model, task_id=tid())
    charlie.wait(task_id, timeout=60)
    with console.bearer() as http:
        info = http.get(f"/api/tasks/{task_id}").json()
        assert info["id"] == task_id and info["status"] == "succeeded"
        assert info["created_at"] == charlie.get_task(task_id).created_at.isoformat()
        assert set(info) == set(charlie.get_task(task_id).__dataclass_fields__)
        transcript = http.get(f"/api/tasks/{task_id}/transcript").json()
        assert [e["kind"] for e in transcript] == [e.kind for e in charlie.transcript(task_id)]
        (call,) = http.get(f"/api/tasks/{task_id}/calls").json()
        assert call["call_id"] == "a" and call["outcome"] == "ok" and call["result"] == "x"
        assert set(call) == set(charlie.calls(task_id)[0].__dataclass_fields__)
        history = http.get(f"/api/tasks/{task_id}/history").json()
        assert history[0]["from_phase"] == "load_context" and "worker" in history[0]
        assert http.get(f"/api/tasks/{task_id}/actions").json() == []
        assert re.fullmatch(
            r"[0-9a-f]{16}", http.get(f"/api/tasks/{task_id}/revision").json()["revision"]
        )
        page = http.get("/api/tasks", params={"q": task_id}).json()
        assert [t["id"] for t in page["tasks"]] == [task_id] and page["next_before"] is None
        assert http.get("/api/tasks/nope-such-task").status_code == 404
        assert http.get("/api/tasks", params={"status": "bogus"}).status_code == 400


def test_actions_over_the_api_return_the_record_and_refusals_have_their_status(
    console: Console, cluster: Cluster, script
) -> None:
    task_id = held_for_approval(script, "api-1")
    with console.bearer() as http:
        r = http.post(f"/api/tasks/{task_id}/approve", json={"call_id": "w", "note": "via api"})
        assert r.status_code == 200, r.text
        record = r.json()
        assert record["action"] == "approve" and record["call_id"] == "w"
        assert record["actor"] == f"ui:{OPERATOR}" and record["note"] == "via api"
        again = http.post(f"/api/tasks/{task_id}/deny", json={"call_id": "w", "reason": "no"})
        assert again.status_code == 409 and "already decided" in again.json()["error"]
        missing = http.post(f"/api/tasks/{task_id}/approve", json={"call_id": "nope"})
        assert missing.status_code == 404
        assert http.post("/api/tasks/no-such-task/cancel", json={}).status_code == 404
        assert http.post(f"/api/tasks/{task_id}/deny", json={"call_id": "w"}).status_code == 400
        assert http.post(f"/api/tasks/{task_id}/approve", content=b"[1]").status_code == 400
        assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
        finished = http.post(f"/api/tasks/{task_id}/send", json={"text": "late"})
        assert finished.status_code == 400 and "fork" in finished.json()["error"]
    (recorded,) = charlie.actions(task_id)
    assert recorded.actor == f"ui:{OPERATOR}"


def test_a_forged_post_is_refused(console: Console, cluster: Cluster, script) -> None:
    """A form post without the XSRF token (another site's page posting with the browser's
    session cookie) is refused, on the pages and on the API; nothing is recorded."""
    task_id = held_for_approval(script, "xsrf-1")
    with console.session() as http:
        forged = http.post(f"/tasks/{task_id}/approve", data={"call_id": "w"})
        assert forged.status_code == 403
        forged_api = http.post(f"/api/tasks/{task_id}/approve", json={"call_id": "w"})
        assert forged_api.status_code == 403
        wrong = http.post(f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": "2|00|00|00"})
        assert wrong.status_code == 403
        assert charlie.actions(task_id) == []
        # the same post with the page's own form token goes through
        page = http.get(f"/tasks/{task_id}").text
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page)
        assert xsrf is not None
        ok = http.post(f"/tasks/{task_id}/approve", data={"call_id": "w", "_xsrf": xsrf.group(1)})
        assert ok.status_code == 303
    (record,) = charlie.actions(task_id)
    assert record.action.value == "approve" and record.actor == f"ui:{OPERATOR}"
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.SUCCEEDED
