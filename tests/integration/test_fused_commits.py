"""Fused commits: the same run, its merged transactions written in one statement each
or step by step, leaves the same rows.

On PostgreSQL a worker computes a merged transaction's steps from what it knows and writes
their net effect in one statement (charlie/store/fused.py), where the stepwise path reads and
writes each step in turn. Both must record the same history: every transition with its own
row and version (I1, I2, I21), the same transcript (I6, I7, I8), the same call records (their
outcomes, results, finishing order, who started them), the same task. Each run here has a
cluster of its own (its own database and Redis database), one with CHARLIE_FUSE_COMMITS=0, and
its script covers the shapes a turn takes: a read run by the worker that dispatched it (its
start in A), a write (its start apart), two calls run at once by that worker (threadsafe
tools), a fan-out published to the workers (a tool that is not threadsafe), calls born settled
(invalid arguments, an unknown tool), a float whose stored form jsonb changes (``1e-07``:
not predicted, so written step by step), and a final answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.conftest import BACKEND
from tests.support.cluster import (
    REPO,
    Backend,
    cluster_env,
    free_port,
    recreate_postgres_database,
)
from tests.support.metrics import by, scrape

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not (BACKEND.database_url or "").startswith("postgresql")
        or not (BACKEND.broker_url or "").startswith("redis"),
        reason="fused commits are PostgreSQL's (SQLite writes every step on its own); these "
        "clusters run on the PostgreSQL + Redis round",
    ),
]

SCRIPT = [
    {"tool_calls": [{"id": "r", "name": "sleep_then", "arguments": {"seconds": 0, "value": "a"}}]},
    {"tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "fused-w"}}]},
    {
        "say": "two at once",
        "tool_calls": [
            {"id": "f1", "name": "sleep_then", "arguments": {"seconds": 0, "value": "b"}},
            {"id": "f2", "name": "sleep_then", "arguments": {"seconds": 1, "value": "c"}},
        ],
    },
    {
        "tool_calls": [
            {"id": "p1", "name": "sleep_then", "arguments": {"seconds": 1, "value": "d"}},
            {"id": "p2", "name": "fail_politely", "arguments": {"reason": "published"}},
        ],
    },
    {
        "tool_calls": [
            {"id": "bad", "name": "sleep_then", "arguments": {"value": 3}},
            {"id": "ghost", "name": "no_such_tool", "arguments": {}},
        ]
    },
    {"tool_calls": [{"id": "num", "name": "echo_number", "arguments": {"value": 1e-07}}]},
    {"say": "done"},
]


def _rows(url: str, task_id: str) -> dict[str, Any]:
    """The run's rows, with what differs between two clusters left out (times, worker names,
    row ids) but their presence and order kept."""
    engine = create_engine(url)
    xid = f"x-{task_id}"
    with engine.connect() as conn:
        run = conn.execute(
            text(
                "SELECT phase, version, turn, next_seq, state, attempts, inbox, model_calls, "
                "model_repeats, error, lease_owner IS NULL AS free, wake_at IS NULL AS no_wake "
                "FROM executions WHERE id = :x"
            ),
            {"x": xid},
        ).one()
        transitions = conn.execute(
            text(
                "SELECT from_phase, to_phase, version FROM transitions WHERE execution_id = :x "
                "ORDER BY id"
            ),
            {"x": xid},
        ).all()
        items = conn.execute(
            text(
                "SELECT seq, turn, kind, call_id, payload FROM transcript_items "
                "WHERE execution_id = :x ORDER BY seq"
            ),
            {"x": xid},
        ).all()
        calls = conn.execute(
            text(
                "SELECT turn, call_id, idx, name, arguments, effect, resumable, state, outcome, "
                "result, attempts, finish_order, hold, hold_info, on_interrupt, late_reports, "
                "dispatch_version, implementation, queued_at IS NULL AS never_queued, "
                "started_by IS NULL AS never_started, started_at <= settled_at AS in_order, "
                "settled_by = 'validation' AS born_settled, lease_owner, lease_until, "
                "round(extract(epoch FROM deadline_at - queued_at)) AS deadline "
                "FROM tool_calls WHERE execution_id = :x ORDER BY turn, idx"
            ),
            {"x": xid},
        ).all()
        task = conn.execute(
            text(
                "SELECT status, result, error, input_tokens, output_tokens, "
                "started_at IS NOT NULL AS started FROM tasks WHERE id = :t"
            ),
            {"t": task_id},
        ).one()
    engine.dispose()
    return {
        "run": tuple(run),
        "transitions": [tuple(r) for r in transitions],
        "items": [tuple(r) for r in items],
        "calls": [tuple(r) for r in calls],
        "task": tuple(task),
    }


def _run_once(
    tmp_path: Path, name: str, redis_db: int, fuse: bool
) -> tuple[dict[str, Any], dict[str, float]]:
    """The run's rows, and its worker's fused commits by commit and result (Prometheus)."""
    assert BACKEND.database_url is not None and BACKEND.broker_url is not None
    db = BACKEND.database_url.rsplit("/", 1)[0] + f"/charlie_test_fused_{name}"
    broker = BACKEND.broker_url.rsplit("/", 1)[0] + f"/{redis_db}"
    recreate_postgres_database(db)
    import redis

    redis.Redis.from_url(broker).flushdb()
    home = tmp_path / name
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update(cluster_env(home, Backend("postgres", db, broker)))
    port = free_port()
    env.update(
        CHARLIE_FUSE_COMMITS="1" if fuse else "0",
        CHARLIE_METRICS_PORT=str(port),
        PYTHONPATH=str(REPO),
    )
    run = [sys.executable, "-m", "charlie"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    with open(home / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [*run, "worker", "-c", "2"], env=env, start_new_session=True, stdout=log, stderr=log
        )
    try:
        script = home / "script.json"
        script.write_text(json.dumps(SCRIPT))
        task_id = f"fused-{name}"
        tools = ["sleep_then", "ledger_write", "echo_number", "fail_politely"]
        done = subprocess.run(
            [*run, "submit", "fused commits", "--model", f"scripted:{script}", "--task-id",
             task_id, *(a for t in tools for a in ("--tool", t)), "--wait", "--timeout", "120"],
            env=env, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr, (home / "worker.log").read_text())
        samples = scrape(port)
        fused = {
            f"{commit}:{result}": value
            for result in ("applied", "fell_back")
            for commit, value in by(
                samples, "charlie_fused_commits_total", "commit", result=result
            ).items()
        }
        return _rows(db, task_id), fused
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_a_fused_run_and_a_stepwise_run_leave_the_same_rows(tmp_path: Path) -> None:
    fused, fused_commits = _run_once(tmp_path, "on", 11, fuse=True)
    stepwise, stepwise_commits = _run_once(tmp_path, "off", 13, fuse=False)
    # The fused run did fuse: the first four turns' A; the read's, the write's and the local
    # pair's B (f2 ends last); f1's settle, and the published pair's two; the turn of calls
    # born settled and the turn of 1e-07 (jsonb stores it as 0.0000001: not predicted) went
    # step by step, unsent.
    assert fused_commits == {
        "model_turn:applied": 4,
        "settle_turn:applied": 3,
        "settle_held:applied": 3,
    }, fused_commits
    assert stepwise_commits == {}
    assert fused["task"] == stepwise["task"]
    assert fused["task"][0] == "succeeded"
    assert fused["transitions"] == stepwise["transitions"]
    versions = [t[2] for t in fused["transitions"]]
    assert versions == list(range(1, len(versions) + 1))  # each step its own version (I1, I2)
    assert fused["items"] == stepwise["items"]  # one chronology (I6), results in call order (I7)
    assert fused["calls"] == stepwise["calls"]
    assert fused["run"] == stepwise["run"]
    outcomes = {c[1]: c[8] for c in fused["calls"]}
    assert outcomes == {
        "r": "ok", "w": "ok", "f1": "ok", "f2": "ok", "p1": "ok", "p2": "error", "bad": "error",
        "ghost": "error", "num": "ok",
    }  # fmt: skip
    # the pair ran at once in the worker that dispatched it, the published pair each where a
    # worker took it (started_by is left out of the rows compared: workers are named per run)
