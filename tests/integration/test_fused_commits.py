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
not predicted, so written step by step), a call held for approval with mail sent while it is
held, a delegated child waited for, and a final answer; the task has a tokens budget, its
first model call waits for capacity (its provider limit paused until the run is seen waiting),
and its transcript outgrows the model's window (a compaction).
Every column that does not name a time or a worker is compared (I1, I3, I30, I31).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
    {
        "reasoning": "a write a person approves",
        "tool_calls": [{"id": "ap", "name": "approved_write", "arguments": {"key": "fused-ap"}}],
    },
    {
        "tool_calls": [
            {"id": "d", "name": "delegate", "arguments": {"prompt": "child", "model": "CHILD"}}
        ]
    },
    {
        "tool_calls": [
            {"id": "wt", "name": "wait_for_task", "arguments": {"task_id": "{task_id}.7.d"}}
        ]
    },
    {"say": "done"},
]
CHILD_SCRIPT = [{"say": "the child's answer"}]
#: the limit every scripted model call is under (paused at first: a capacity wait)
LIMITS = {"scripted:": {"concurrency": 4}}
MAIL = "mail sent while the approval is held"
#: the scripted models' context window, in tokens: the tools' schemas and the first turns fit,
#: the transcript outgrows it at turn 7 (measured: 1,200 compacts at turn 6, 1,400 at 9)
WINDOW = 1300


def _rows(url: str, task_id: str) -> dict[str, Any]:
    """The run's rows, with what differs between two clusters left out (times, worker names,
    row ids) but their presence and order kept."""
    engine = create_engine(url)
    xid = f"x-{task_id}"
    with engine.connect() as conn:
        run = conn.execute(
            text(
                "SELECT phase, version, turn, next_seq, state, attempts, inbox, model_calls, "
                "model_repeats, error, lease_owner IS NULL AS free, lease_until IS NULL AS "
                "no_lease, wake_at IS NULL AS no_wake, swept_at IS NULL AS never_swept "
                "FROM executions WHERE id = :x"
            ),
            {"x": xid},
        ).one()
        transitions = conn.execute(
            text(
                "SELECT from_phase, to_phase, version, note FROM transitions "
                "WHERE execution_id = :x ORDER BY id"
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
        task_columns = (
            "SELECT id, parent_id, parent_call_id, status, result, error, input_tokens, "
            "output_tokens, reasoning_tokens, cache_read_tokens, cache_write_tokens, budget, "
            "priority, approve, started_at IS NOT NULL AS started, finished_at IS NOT NULL AS "
            "finished, cancel_requested_at IS NULL AS never_canceled FROM tasks "
        )
        task = conn.execute(text(task_columns + "WHERE id = :t"), {"t": task_id}).one()
        children = conn.execute(
            text(task_columns + "WHERE parent_id = :t ORDER BY id"), {"t": task_id}
        ).all()
        messages = conn.execute(
            text(
                "SELECT count(*) FROM transcript_items WHERE execution_id = :x "
                "AND payload::text LIKE :mail"
            ),
            {"x": xid, "mail": f"%{MAIL}%"},
        ).scalar_one()
    engine.dispose()
    return {
        "run": tuple(run),
        "transitions": [tuple(r) for r in transitions],
        "items": [tuple(r) for r in items],
        "calls": [tuple(r) for r in calls],
        "task": tuple(task),
        "children": [tuple(r) for r in children],
        "mail": messages,
    }


def _until(what: str, check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def _scalar(url: str, sql: str, **params: Any) -> Any:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            return conn.execute(text(sql), params).scalar()
    finally:
        engine.dispose()


def _run_once(
    tmp_path: Path, name: str, redis_db: int, fuse: bool
) -> tuple[dict[str, Any], dict[str, float]]:
    """The run's rows, and its worker's fused commits by commit and result (Prometheus)."""
    assert BACKEND.database_url is not None and BACKEND.broker_url is not None
    # Databases named after the session's own (as tests/support/databases.own_database names
    # them), so sessions on one server do not empty each other's.
    db = f"{BACKEND.database_url}_fused_{name}"
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
        CHARLIE_MODEL_LIMITS=json.dumps(LIMITS),
        # a window the transcript outgrows at the delegation's turn: a compaction (I29)
        CHARLIE_MODEL_CONTEXT_TOKENS=str(WINDOW),
        PYTHONPATH=str(REPO),
    )
    run = [sys.executable, "-m", "charlie"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    # The limit paused as a provider's 429 pauses it: the first model call waits for capacity.
    _scalar(
        db,
        "INSERT INTO limit_state (limit_key, paused_until, throttles) "
        "VALUES ('scripted:', now() + interval '10 minutes', 0) RETURNING 1",
    )
    with open(home / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [*run, "worker", "-c", "2"], env=env, start_new_session=True, stdout=log, stderr=log
        )
    try:
        child = tmp_path / "child.json"  # (one path for both runs: the call names it)
        child.write_text(json.dumps(CHILD_SCRIPT))
        script = tmp_path / "script.json"  # (as the child's: a compaction names its model)
        script.write_text(json.dumps(SCRIPT).replace('"CHILD"', json.dumps(f"scripted:{child}")))
        # (the same id in both databases: a child's id, in results and rows, is made of it)
        task_id = "fused"
        xid = f"x-{task_id}"
        tools = [
            "sleep_then",
            "ledger_write",
            "echo_number",
            "fail_politely",
            "approved_write",
            "delegate",
            "wait_for_task",
        ]

        def cli(*args: str) -> None:
            done = subprocess.run(
                [*run, *args], env=env, capture_output=True, text=True, timeout=150
            )
            log = (home / "worker.log").read_text()
            assert done.returncode == 0, (args, done.stdout, done.stderr, log)

        cli("submit", "fused commits", "--model", f"scripted:{script}", "--task-id", task_id,
            *(a for t in tools for a in ("--tool", t)), "--budget-tokens", "100000")  # fmt: skip
        # The first model call waits for capacity; the pause lifted once it is seen waiting.
        _until(
            "a capacity wait",
            lambda: _scalar(db, "SELECT state ? 'capacity' FROM executions WHERE id = :x", x=xid),
        )
        _scalar(db, "UPDATE limit_state SET paused_until = NULL RETURNING 1")
        # (its tick, as a sweep would publish it at its wake-up: this cluster has no beat)
        wake = (
            "from charlie.domain import Phase; from charlie.runtime import get_producer; "
            f"get_producer().publisher.tick({xid!r}, Phase.CALL_MODEL, 1)"
        )
        subprocess.run([sys.executable, "-c", wake], env=env, check=True, timeout=60)
        # Mail sent while the approval holds the run; then the approval.
        _until(
            "the approval's hold",
            lambda: _scalar(
                db,
                "SELECT hold = 'approval' FROM tool_calls WHERE execution_id = :x "
                "AND call_id = 'ap'",
                x=xid,
            ),
        )
        cli("send", task_id, MAIL, "--message-id", "fused-mail")
        cli("approve", task_id, "ap")
        cli("wait", task_id, "--timeout", "120")
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


def _redis_db() -> int:
    """A Redis database of the runs' own (one after the other, each emptying it first): the
    session's number plus 8, so sessions on one server (each on its own number) do not share
    it, nor with a session's cluster."""
    assert BACKEND.broker_url is not None
    tail = BACKEND.broker_url.rsplit("/", 1)[1]
    return (int(tail) if tail.isdigit() else 0) + 8 & 15


def test_a_fused_run_and_a_stepwise_run_leave_the_same_rows(tmp_path: Path) -> None:
    fused, fused_commits = _run_once(tmp_path, "on", _redis_db(), fuse=True)
    stepwise, stepwise_commits = _run_once(tmp_path, "off", _redis_db(), fuse=False)
    # The fused run did fuse, and never fell back: the first four turns' A, and the
    # approval's, the delegation's and the wait's; the read's, the write's and the local
    # pair's B (f2 ends last), f1's settle and the published pair's two, and the approved
    # write's, the delegation's and the wait's settles (each one a turn's B or a held settle,
    # as the settles' order falls); the turn of calls born settled and the turn of 1e-07
    # (jsonb stores it as 0.0000001: not predicted) went step by step, unsent.
    assert set(fused_commits) == {
        "model_turn:applied",
        "settle_turn:applied",
        "settle_held:applied",
    }, fused_commits
    assert fused_commits["model_turn:applied"] == 7, fused_commits
    assert fused_commits["settle_turn:applied"] >= 3, fused_commits
    assert fused_commits["settle_held:applied"] >= 3, fused_commits
    assert fused_commits["settle_turn:applied"] + fused_commits["settle_held:applied"] == 9
    assert stepwise_commits == {}
    assert fused["task"] == stepwise["task"]
    assert fused["task"][3] == "succeeded"
    assert fused["transitions"] == stepwise["transitions"]
    versions = [t[2] for t in fused["transitions"]]
    assert versions == list(range(1, len(versions) + 1))  # each step its own version (I1, I2)
    assert fused["items"] == stepwise["items"]  # one chronology (I6), results in call order (I7)
    assert fused["calls"] == stepwise["calls"]
    assert fused["run"] == stepwise["run"]
    assert fused["children"] == stepwise["children"]
    assert [c[3] for c in fused["children"]] == ["succeeded"]
    assert fused["mail"] == stepwise["mail"] == 1
    compactions = [i for i in fused["items"] if i[2] == "compaction"]
    assert compactions, [i[:3] for i in fused["items"]]  # (two, in this script)
    # the budget and a model call that waited for capacity: counted once, no repeat
    assert fused["task"][11] == {"tokens": 100000}, fused["task"]
    assert fused["run"][8] == 0, fused["run"]
    outcomes = {c[1]: c[8] for c in fused["calls"]}
    assert outcomes == {
        "r": "ok", "w": "ok", "f1": "ok", "f2": "ok", "p1": "ok", "p2": "error", "bad": "error",
        "ghost": "error", "num": "ok", "ap": "ok", "d": "ok", "wt": "ok",
    }  # fmt: skip
    # the pair ran at once in the worker that dispatched it, the published pair each where a
    # worker took it (started_by is left out of the rows compared: workers are named per run)
