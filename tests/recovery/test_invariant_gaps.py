"""Recovery tests for invariants the rest of the suite covered weakly or not at all: real
workers over the real broker and database, SIGKILL or SIGSTOP where a crash or a pause is the
point.

- I11: calls never marked started, lost with their invoke messages, start normally.
- I5: no transaction or row lock is held while a tool handler or a model call runs.
- I16: a worker killed after the task was marked terminal, before the run's done transition.
- a lone prefork pool child killed (Celery's WorkerLostError path): the worker lives on.
- two real beats and a killed worker: recovery acts once.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

import charlie
from charlie import api
from charlie.config import settings
from charlie.domain import Phase, TaskStatus
from charlie.store.engine import server_connect_args
from tests.conftest import model_calls, wait_for
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster
from tests.support.tools import read_ledger

pytestmark = [pytest.mark.recovery, pytest.mark.timeout(180)]

Script = Callable[[list[dict[str, Any]]], tuple[str, Path]]


def ledger_for(task_id: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_ledger() if e.get("task") == task_id and e.get("event") == event]


def new_task_id() -> str:
    """A task id chosen before submitting, so a fault point can match this task alone (not a
    run some earlier test left behind)."""
    return f"i7-{uuid.uuid4().hex}"


def is_postgres() -> bool:
    return settings().database_url.startswith("postgresql")


# --- I11 ---------------------------------------------------------------------------------


def test_never_started_calls_lost_with_their_messages_start_normally(
    cluster: Cluster, script: Script
) -> None:
    """I11: the worker dies after the dispatch commit, before it published any invoke message.
    The turn has two calls, so they are published calls in either inline mode (a turn of one
    call would be a local call, started in the dispatch's own commit). Neither was marked
    started, so recovery starts both normally: outcome ok, no `interrupted`, no reconcile, each
    write handler run exactly once, and the next turn is shown both results in call order."""
    task_id = new_task_id()
    cluster.set_faults(
        {
            "tick.after_commit": {
                "action": "kill",
                "times": 1,
                "match": {"phase": "dispatch_tools", "task_id": task_id},
            }
        }
    )
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "ledger_write", "arguments": {"key": "i11-a"}},
                    {"id": "b", "name": "ledger_write", "arguments": {"key": "i11-b"}},
                ]
            },
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "a", "outcome": "ok", "contains": "i11-a"},
                        {"call_id": "b", "outcome": "ok", "contains": "i11-b"},
                    ]
                },
                "say": "both written",
            },
        ]
    )
    charlie.submit("lost invokes", model=model, task_id=task_id)
    wait_for(lambda: cluster.fault_count("tick.after_commit") == 1, timeout=60)
    # The dispatch committed (queued, with its deadline) but nothing was started: the kill came
    # before the publish, and the sweep re-publishes only a stall period (2 s) later.
    lost = api.calls(task_id)
    assert [(c.state, c.started_at) for c in lost] == [("pending", None)] * 2, lost
    assert all(c.queued_at is not None for c in lost)

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    records = api.calls(task_id)
    for call, key in zip(records, ("i11-a", "i11-b"), strict=True):
        assert call.outcome == "ok", call.result
        assert call.result == {"written": key}  # run, not reconciled nor interrupted
        assert call.started_by and call.late_reports == 0
        assert [e["key"] for e in ledger_for(task_id, "write") if e["call"] == call.call_id] == [
            key
        ]
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1]
    assert info.model_repeats == 0
    assert_every_call_has_one_result(task_id)
    # the starts the sweep's re-publish led to were told to watchers, once each (I9, I28)
    told = [e.data["call_id"] for e in charlie.events(task_id) if e.type == "tool_started"]
    assert sorted(told) == ["a", "b"]


# --- I5 ----------------------------------------------------------------------------------


@contextlib.contextmanager
def pg_monitor() -> Iterator[Callable[[], dict[tuple[int, datetime], dict[str, Any]]]]:
    """A sampler of the open transactions of every other backend on the test database, with
    the transaction-id and tuple locks each holds."""
    # (through a PgBouncer too: no statement prepared on the server, server_connect_args)
    url = settings().database_url
    engine = create_engine(url, isolation_level="AUTOCOMMIT", connect_args=server_connect_args(url))
    query = text(
        """
        SELECT a.pid, a.xact_start, a.state, a.application_name, a.backend_xid::text AS xid,
               left(a.query, 200) AS query,
               ARRAY(SELECT l.locktype || ':' || l.mode FROM pg_locks l
                     WHERE l.pid = a.pid AND l.locktype IN ('tuple', 'transactionid')) AS locks
        FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
          AND a.xact_start IS NOT NULL
        """
    )

    def sample() -> dict[tuple[int, datetime], dict[str, Any]]:
        with engine.connect() as conn:
            return {(r.pid, r.xact_start): dict(r._mapping) for r in conn.execute(query)}

    try:
        yield sample
    finally:
        engine.dispose()


def sqlite_write_lock_free() -> bool:
    """Whether the test can take SQLite's write lock right now (BEGIN IMMEDIATE, no waiting)."""
    path = settings().database_url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def watch_window(
    started: Callable[[], bool], ended: Callable[[], bool], timeout: float = 60
) -> dict[str, Any]:
    """While slow work runs (from ``started`` true until ``ended`` true), look at the database
    from outside. PostgreSQL: the transactions open in the first look and still open in the last
    look taken while the work ran (so open across it), with their locks. SQLite: whether the
    write lock could be taken at some moment during the work."""
    wait_for(started, timeout=timeout, interval=0.02)
    looks = 0
    if is_postgres():
        with pg_monitor() as sample:
            first = sample()
            last = first
            while True:
                current = sample()
                if ended():
                    break
                last = current
                looks += 1
                time.sleep(0.05)
        held = {key: last[key] for key in first.keys() & last.keys()}
        return {"looks": looks, "held_across": held}
    free = 0
    while not ended():
        looks += 1
        free += sqlite_write_lock_free()
        time.sleep(0.05)
    return {"looks": looks, "lock_free_looks": free}


@pytest.mark.parametrize("work", ["tool_handler", "model_call"])
def test_no_transaction_or_row_lock_is_held_while_slow_work_runs(
    cluster: Cluster, script: Script, work: str
) -> None:
    """I5: while a tool handler sleeps, and while a model call sleeps, no Charlie backend holds
    a transaction open across it: none is `idle in transaction` from before the work began to
    the moment before it ended, so none holds its row locks or transaction id that long (the
    work's own lease heartbeat commits short transactions of its own, which come and go).
    SQLite has no pg_locks: there the test takes the database's write lock (BEGIN IMMEDIATE,
    without waiting) at some moment while the work runs, which a write transaction held across
    the work would prevent."""
    if work == "tool_handler":
        model, _ = script(
            [
                {
                    "tool_calls": [
                        {
                            "id": "s",
                            "name": "sleep_then",
                            "arguments": {"seconds": 4, "value": "slept"},
                        }
                    ]
                },
                {"say": "done"},
            ]
        )
        task_id = charlie.submit("slow handler", model=model)

        def started() -> bool:
            return bool(ledger_for(task_id, "sleep_then.start"))

        def ended() -> bool:
            return bool(ledger_for(task_id, "sleep_then.end"))

    else:
        model, ledger = script([{"say": "slowly", "sleep": 4}])
        task_id = charlie.submit("slow model", model=model)

        def started() -> bool:
            return bool(model_calls(ledger))

        def ended() -> bool:
            return api.get_task(task_id).phase is not Phase.CALL_MODEL

    seen = watch_window(started, ended)
    assert seen["looks"] >= 2, seen  # the looks were taken while the work ran
    if is_postgres():
        assert seen["held_across"] == {}, seen
    else:
        assert seen["lock_free_looks"] >= 1, seen
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error


# --- I16 ---------------------------------------------------------------------------------


def test_kill_after_the_task_is_terminal_before_done_writes_no_second_result(
    cluster: Cluster, script: Script
) -> None:
    """I16: the worker dies in report_terminal after `scheduler.finish` committed the task's
    result and before the run's done transition (the fault point `tick.before_commit`, which a
    slow phase hits after its work). Recovery runs report_terminal again, finds the task already
    terminal (a benign outcome), and moves the run to done: the result and its time are the
    first write's, no second result is written, the model is not called again."""
    task_id = new_task_id()
    cluster.set_faults(
        {
            "tick.before_commit": {
                "action": "kill",
                "times": 1,
                "match": {"phase": "report_terminal", "task_id": task_id},
            }
        }
    )
    model, ledger = script([{"say": "the one answer"}])
    charlie.submit("terminal then killed", model=model, task_id=task_id)
    wait_for(lambda: cluster.fault_count("tick.before_commit") == 1, timeout=60)
    first = api.get_task(task_id)
    assert first.status is TaskStatus.SUCCEEDED  # the scheduler's write committed
    assert first.phase is Phase.REPORT_TERMINAL  # the run's transition did not

    wait_for(lambda: api.get_task(task_id).phase is Phase.DONE, timeout=60)
    info = api.get_task(task_id)
    assert info.status is TaskStatus.SUCCEEDED
    assert info.result == first.result and info.result["answer"] == "the one answer"
    assert info.finished_at == first.finished_at  # not written again
    reports = [h for h in api.history(task_id) if h["from_phase"] == "report_terminal"]
    assert len(reports) == 1, reports
    assert reports[0]["to_phase"] == "done"
    assert reports[0]["note"] == "task already terminal (benign)"
    assert len(model_calls(ledger)) == 1
    assert info.model_calls == 1 and info.model_repeats == 0


# --- a lone pool child -------------------------------------------------------------------


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def kill_lone_child(cluster: Cluster, pid: int) -> Any:
    """SIGKILL one pool child (not its process group); returns the worker's main process."""
    main = parent_pid(pid)
    worker = next(w for w in cluster.workers if w.pid == main)  # a pool child of a worker
    os.kill(pid, signal.SIGKILL)
    return worker


def wait_worker_lost(cluster: Cluster, pid: int) -> None:
    """The worker's main process saw its child die: Celery's WorkerLostError path."""
    pattern = re.compile(rf"pid:{pid}\b.*SIGKILL|WorkerLostError")

    def seen() -> bool:
        return any(
            f"pid:{pid}" in log.read_text(errors="replace")
            and pattern.search(log.read_text(errors="replace"))
            for log in cluster.home.glob("worker-*.log")
        )

    wait_for(seen, timeout=30)


@pytest.mark.parametrize("where", ["tool_handler", "model_call"])
def test_a_lone_pool_child_killed_leaves_its_worker_running(
    cluster: Cluster, script: Script, where: str
) -> None:
    """A prefork pool child SIGKILLed alone, while it runs a write tool's handler or a model
    call: the worker's main process survives (Celery replaces the child, WorkerLostError), and
    the run completes by the invariants: the started write settles `interrupted` and is never
    run again (I9, I10, I8: one result, which the next turn is shown); the model call, whose
    output was not committed, is the only work repeated (I3)."""
    restarts = cluster.restarts
    if where == "tool_handler":
        model, ledger = script(
            [
                {
                    "tool_calls": [
                        {
                            "id": "w",
                            "name": "ledger_write",
                            "arguments": {"key": "lone-child", "hold": 30},
                        }
                    ]
                },
                {
                    "expect": {"tool_results": [{"call_id": "w", "outcome": "interrupted"}]},
                    "say": "checked",
                },
            ]
        )
        task_id = charlie.submit("lone child in a tool", model=model)
        pid = int(wait_for(lambda: ledger_for(task_id, "write"))[0]["pid"])
    else:
        model, ledger = script([{"say": "slow answer", "sleep": 4}])
        task_id = charlie.submit("lone child in a model call", model=model)
        pid = int(wait_for(lambda: model_calls(ledger))[0]["pid"])
    worker = kill_lone_child(cluster, pid)
    wait_worker_lost(cluster, pid)

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert worker.poll() is None  # the main process lived on
    assert cluster.restarts == restarts  # no whole worker died
    if where == "tool_handler":
        call = api.calls(task_id)[0]
        assert call.outcome == "interrupted" and call.late_reports == 0
        assert len(ledger_for(task_id, "write")) == 1  # never run again
        assert [c["turn"] for c in model_calls(ledger)] == [0, 1]
        assert_every_call_has_one_result(task_id)
    else:
        assert [c["turn"] for c in model_calls(ledger)] == [0, 0]
        assert info.model_calls == 1 and info.model_repeats == 1


# --- two beats ---------------------------------------------------------------------------

_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): ")


def log_lines(cluster: Cluster, message: str, execution_id: str) -> list[tuple[datetime, str]]:
    found = []
    # Workers' and beats' logs: wherever the sweeps run (a beat may run them itself).
    for log in cluster.home.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if message in line and f"execution_id={execution_id}" in line:
                stamp = _LOG_TIME.match(line)
                assert stamp, line
                found.append((datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f"), line))
    return sorted(found)


@contextlib.contextmanager
def workers_paused(cluster: Cluster) -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    """SIGSTOP every worker (main process and pool) while the beats go on sending sweeps.
    Yields ``(pause_newcomers, resume)``: the first stops workers the supervisor started since
    (a replacement for a killed one), the second sends SIGCONT to all (also sent on leaving).
    Resumed, the pools take the queued sweeps at once, so sweeps of the same rows run side by
    side."""
    paused: list[int] = []

    def pause_newcomers() -> None:
        for worker in cluster.alive_workers():
            if worker.pid not in paused:
                os.killpg(worker.pid, signal.SIGSTOP)
                paused.append(worker.pid)

    def resume() -> None:
        for pgid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)

    pause_newcomers()
    try:
        yield pause_newcomers, resume
    finally:
        resume()


@contextlib.contextmanager
def run_row_held(execution_id: str) -> Iterator[Callable[[], int]]:
    """Hold the run's row from the test (PostgreSQL: FOR UPDATE), so the sweeps that resume
    meanwhile have made their reads and queue up at their compare-and-set (or at locking the
    run, as a settler does); on release they go one after another, each re-checking its
    condition. Yields a count of the backends waiting for a lock (-1 on SQLite, where nothing
    is held and the sweeps only run side by side)."""
    url = settings().database_url
    if url.startswith("postgresql"):
        engine = create_engine(url, connect_args=server_connect_args(url))
        monitor = create_engine(
            url, isolation_level="AUTOCOMMIT", connect_args=server_connect_args(url)
        )
        waiting = text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )

        def blocked() -> int:
            with monitor.connect() as conn:
                return int(conn.execute(waiting).scalar_one())

        try:
            with engine.begin() as conn:
                conn.execute(
                    text("SELECT id FROM executions WHERE id = :x FOR UPDATE"), {"x": execution_id}
                )
                yield blocked
        finally:
            engine.dispose()
            monitor.dispose()
        return
    # SQLite: nothing is held. The test's BEGIN IMMEDIATE would wait behind a paused worker
    # that holds the write lock, and each sweep's first write (its heartbeat) comes before its
    # reads, so a held lock would serialise the sweeps rather than make them meet.
    yield lambda: -1


def sweeps_received_since(cluster: Cluster, since: float) -> int:
    """Sweep tasks the workers received after ``since`` (an epoch time), from their logs."""
    count = 0
    for log in cluster.home.glob("worker-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            stamp = _LOG_TIME.match(line)
            if stamp and "Task charlie.sweep." in line and line.endswith("received"):
                at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                count += at >= since
    return count


def race_the_sweeps(cluster: Cluster, execution_id: str, until: float) -> None:
    """Pause every worker until ``until`` (an epoch time past which the row is due for
    recovery) while both beats keep sending sweeps; then hold the run's row and resume them, so
    the queued sweeps read the same due row side by side and meet at its compare-and-set."""
    with workers_paused(cluster) as (pause_newcomers, resume):

        def due() -> bool:
            pause_newcomers()
            return time.time() > until

        wait_for(due, timeout=30)
        with run_row_held(execution_id) as blocked:
            resumed = time.time()
            resume()
            # Not a condition to assert: how many sweeps meet there is up to the scheduling.
            with contextlib.suppress(AssertionError):
                if blocked() >= 0:
                    wait_for(lambda: blocked() >= 2, timeout=15)
                else:
                    wait_for(lambda: sweeps_received_since(cluster, resumed) >= 6, timeout=5)


def test_two_beats_and_a_killed_worker_recover_each_thing_once(
    cluster: Cluster, script: Script
) -> None:
    """Two real `charlie beat` processes at once. A worker is killed inside a write, and later
    another dies after a model call's commit, before its publish. Each time every worker is
    paused (SIGSTOP) past the stall period while both beats go on sending sweeps, then resumed,
    so the queued sweeps of both beats run side by side on the same rows. Recovery still acts
    once: the call is settled `interrupted` once (I10, I12), the lost tick is re-published at
    most once per stall period (I4), each call has one result (I8) and no late report, the write
    ran once, every transition has its own version (I1, I2), the model is not called again."""
    stall = float(settings().stall_seconds)
    cluster.start_beat()
    assert len([b for b in cluster.beats if b.poll() is None]) == 2
    model, ledger = script(
        [
            {
                "tool_calls": [
                    {"id": "w", "name": "ledger_write", "arguments": {"key": "beats", "hold": 30}}
                ]
            },
            {
                "expect": {"tool_results": [{"call_id": "w", "outcome": "interrupted"}]},
                # A write, so that the crash just after this commit leaves it pending (its
                # start commits on its own) whether or not the commit is fused.
                "tool_calls": [
                    {"id": "r", "name": "ledger_write", "arguments": {"key": "beats-r"}}
                ],
            },
            {"expect": {"tool_results": [{"call_id": "r", "outcome": "ok"}]}, "say": "done"},
        ]
    )
    task_id = charlie.submit("two beats", model=model)
    execution_id = f"x-{task_id}"
    writes = wait_for(lambda: ledger_for(task_id, "write"))
    # The next call_model commit (turn 2's) kills its worker before the publish.
    cluster.set_faults(
        {
            "tick.after_commit": {
                "action": "kill",
                "times": 1,
                "match": {"phase": "call_model", "task_id": task_id},
            }
        }
    )
    cluster.kill_pid_group(int(writes[0]["pid"]))
    assert api.calls(task_id)[0].state == "started"  # its lease has not lapsed yet
    race_the_sweeps(cluster, execution_id, time.time() + settings().lease_seconds + 1 + stall + 1)

    wait_for(lambda: cluster.fault_count("tick.after_commit") == 1, timeout=60, interval=0.02)
    race_the_sweeps(cluster, execution_id, time.time() + stall + 1.5)

    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    wait_for(lambda: api.get_task(task_id).phase is Phase.DONE, timeout=30)
    for beat in cluster.beats:
        assert beat.poll() is None
    records = api.calls(task_id)
    assert [(c.call_id, c.outcome, c.late_reports) for c in records] == [
        ("w", "interrupted", 0),
        ("r", "ok", 0),
    ]
    writes = [w["key"] for w in ledger_for(task_id, "write")]
    assert sorted(writes) == ["beats", "beats-r"], writes  # each ran once
    assert_every_call_has_one_result(task_id)
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1, 2]
    assert info.model_repeats == 0

    versions = [h["version"] for h in api.history(task_id)]
    assert len(versions) == len(set(versions)), api.history(task_id)
    interrupted = log_lines(cluster, "call interrupted", execution_id)
    assert len(interrupted) == 1, interrupted
    republished = log_lines(cluster, "re-published tick", execution_id)
    assert republished, "the lost tick was found by a sweep"
    by_row: dict[str, list[datetime]] = {}
    for at, line in republished:
        row = re.search(r"phase=(\S+) version=(\d+)", line)
        assert row, line
        by_row.setdefault(row.group(0), []).append(at)
    for row_key, times in by_row.items():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # A row's tick is re-published at most once per stall period, whichever beat's sweep
        # asked (half the period: log times are taken a moment after each compare-and-set).
        assert all(g >= timedelta(seconds=stall / 2) for g in gaps), (row_key, republished)
