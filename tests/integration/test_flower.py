"""I21: each phase is its own Celery task name, so Flower shows the loop as it runs.

Runs its own worker (task events on) and Flower against a separate Redis database and a
separate database, so the session cluster (events off) cannot take the messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.cluster import REPO, Backend, free_port, recreate_postgres_database

pytestmark = pytest.mark.timeout(120)


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
        FLOWER_UNAUTHENTICATED_API="true",
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
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "charlie.app",
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
            ],
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
        deadline = time.monotonic() + 20
        names: set[str] = set()
        while time.monotonic() < deadline and not expected <= names:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=5) as r:
                names = {t["name"] for t in json.load(r).values()}
            time.sleep(0.5)
        assert expected <= names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert "charlie.phase.call_model" in r.read().decode()
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
