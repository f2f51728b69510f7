"""I21: each phase is its own Celery task name, so Flower shows the loop as it runs.

Runs its own worker (task events on) and Flower against a separate Redis database and a
separate database, so the session cluster (events off) cannot take the messages.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.cluster import REPO, Backend, free_port, recreate_postgres_database

pytestmark = pytest.mark.timeout(120)

AUTH = "charlie:flower-test-password"
SECRET = "SECRET-PROMPT-4f1c9a"


def _request(port: int, path: str) -> urllib.request.Request:
    token = base64.b64encode(AUTH.encode()).decode()
    return urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Basic {token}"}
    )


def _get(port: int, path: str) -> dict[str, dict[str, object]]:
    with urllib.request.urlopen(_request(port, path), timeout=5) as r:
        return dict(json.load(r))


def test_flower_refuses_to_start_without_authentication(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLIE_", "FLOWER_"))}
    env.update(CHARLIE_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "charlie", "flower"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "refusing to start Flower without authentication" in done.stderr


def test_flower_shows_every_phase(backend: Backend, tmp_path: Path) -> None:
    if not (backend.broker_url or "").startswith("redis"):
        pytest.skip("Flower reads worker events; this test runs on the Redis broker round")
    db = f"sqlite:///{tmp_path / 'flower.db'}"
    if backend.database_url and backend.database_url.startswith("postgresql"):
        db = backend.database_url.rsplit("/", 1)[0] + "/charlie_test_flower"
        recreate_postgres_database(db)
    broker = backend.broker_url.rsplit("/", 1)[0] + "/12"  # type: ignore[union-attr]
    import redis

    redis.Redis.from_url(broker).flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update(
        CHARLIE_HOME=str(tmp_path),
        CHARLIE_DATABASE_URL=db,
        CHARLIE_BROKER_URL=broker,
        CHARLIE_TASK_EVENTS="1",
        CHARLIE_REMOTE_CONTROL="1",
        PYTHONPATH=str(REPO),
    )
    port = free_port()
    run = [sys.executable, "-m", "charlie"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    procs = [
        subprocess.Popen(
            [*run, "worker", "-E", "-c", "1"],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*run, "flower", f"--port={port}", "--address=127.0.0.1", f"--basic-auth={AUTH}"],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        script = tmp_path / "turns.json"
        script.write_text(
            json.dumps(
                [
                    {"tool_calls": [{"id": "a", "name": "list_files", "arguments": {}}]},
                    {"say": "seen by flower"},
                ]
            )
        )
        time.sleep(4)  # let Flower subscribe to events before the task runs
        done = subprocess.run(
            [
                *run,
                "submit",
                "flower",
                "--model",
                f"scripted:{script}",
                "--wait",
                "--timeout",
                "60",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr
        expected = {
            f"charlie.phase.{p}"
            for p in (
                "load_context",
                "call_model",
                "dispatch_tools",
                "await_tools",
                "advance_turn",
                "report_terminal",
            )
        } | {"charlie.tool.invoke"}
        # Prompts and metadata never reach Flower: sent through Charlie's
        # Celery task, and by a producer whose plain Celery app puts them in its reprs.
        sent = (
            "from celery import Celery; from charlie.worker import submit_task\n"
            f"submit_task.delay({SECRET!r}, model='scripted:{script}', task_id='flower-delay',"
            f" metadata={{'token': {SECRET!r}}})\n"
            f"Celery(broker={broker!r}).send_task('charlie.submit', kwargs={{'prompt': {SECRET!r},"
            f" 'model': 'scripted:{script}', 'task_id': 'flower-plain'}})\n"
        )
        subprocess.run([sys.executable, "-c", sent], env=env, check=True, timeout=60)
        deadline = time.monotonic() + 30
        names: set[str] = set()
        tasks: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            tasks = _get(port, "/api/tasks")
            names = {str(t["name"]) for t in tasks.values()}
            submits = [t for t in tasks.values() if t["name"] == "charlie.submit"]
            if expected <= names and len(submits) == 2 and all(t["kwargs"] for t in submits):
                break
            time.sleep(0.5)
        assert expected <= names
        submits = [t for t in tasks.values() if t["name"] == "charlie.submit"]
        assert len(submits) == 2, submits
        assert SECRET not in json.dumps(tasks)
        assert all("<prompt:" in str(t["args"]) + str(t["kwargs"]) for t in submits), submits
        metrics = urllib.request.urlopen(_request(port, "/metrics"), timeout=5).read().decode()
        assert "charlie.phase.call_model" in metrics
        assert SECRET not in metrics
        # and nothing without the password
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=5)
        assert refused.value.code == 401
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
