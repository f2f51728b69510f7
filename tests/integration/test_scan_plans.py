"""The sweeps' scans read an index, not the tables' history (I4, I10, I11, I13): on a database
holding thousands of finished runs and settled calls and a few live ones, PostgreSQL plans
every scan a sweep round, the late watch, a limit's wake-up, the metrics' gauges, the task
list and a budget's walk of a task's children make without a sequential scan of the runs, the
calls or the tasks. An index dropped that a scan needed shows here as a ``Seq Scan``.

A partial index (migrations 0015, 0016, 0018) serves a statement planned for any value only
where the statement says its predicate as the same literal; Charlie's scans are planned with
their values (nothing but the fused commits is prepared), which prove a predicate either way,
so the literals are checked in the statements' text as well."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, insert, text

from charlie.domain import CallState, Outcome, Phase, TaskStatus
from charlie.store import calls, limits, reads, scans, spend
from charlie.store.schema import executions, tasks, tool_calls
from tests.conftest import BACKEND
from tests.support.databases import own_database

RUNS = 20_000
CALLS_PER_RUN = 3
LIVE_EVERY = 400  # one live run (and one started call) in this many
TABLES = ("executions", "tool_calls", "tasks")


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    if not (BACKEND.database_url or "").startswith("postgresql"):
        pytest.skip("plans are PostgreSQL's here (the embedded default's tables stay small)")
    with own_database(tmp_path_factory, "scan_plans") as engine:
        now = datetime.now(UTC)
        task_rows, run_rows, call_rows = [], [], []
        for n in range(RUNS):
            live = n % LIVE_EVERY == 0
            task_rows.append(
                {
                    "id": f"t{n}",
                    "parent_id": f"t{n - 1}" if n % 10 == 1 else None,
                    "prompt": "p",
                    "model": "m",
                    "metadata_": {},
                    "status": (TaskStatus.RUNNING if live else TaskStatus.SUCCEEDED).value,
                    "created_at": now - timedelta(seconds=n),
                }
            )
            run_rows.append(
                {
                    "id": f"x{n}",
                    "task_id": f"t{n}",
                    "phase": (Phase.CALL_MODEL if live else Phase.DONE).value,
                    "version": 10,
                    "state": {},
                    "turn": CALLS_PER_RUN,
                    "next_seq": 20,
                    "updated_at": now - timedelta(seconds=n),
                    "lease_until": now if live else None,
                    "wake_at": now + timedelta(hours=1) if n % (2 * LIVE_EVERY) == 0 else None,
                    "created_at": now - timedelta(seconds=n),
                }
            )
            for turn in range(CALLS_PER_RUN):
                started = live and turn == CALLS_PER_RUN - 1
                overdue_wait = (n * CALLS_PER_RUN + turn) % 97 == 0
                call_rows.append(
                    {
                        "execution_id": f"x{n}",
                        "call_id": f"c{turn}",
                        "turn": turn,
                        "idx": 0,
                        "name": "lookup",
                        "arguments": {},
                        "effect": "read",
                        "resumable": overdue_wait,
                        "state": (CallState.STARTED if started else CallState.SETTLED).value,
                        "attempts": 1,
                        "late_reports": 0,
                        "outcome": None
                        if started
                        else (Outcome.DEADLINE_EXCEEDED if overdue_wait else Outcome.OK).value,
                        "settled_at": None if started else now - timedelta(seconds=n),
                        # a command's handle on most calls: the overdue waits are not the
                        # only calls with one
                        "handle": f"t{n}" if overdue_wait or turn % 2 else None,
                        "lease_until": now - timedelta(minutes=1) if started else None,
                        "deadline_at": now + timedelta(hours=1),
                    }
                )
        with engine.begin() as conn:
            conn.execute(insert(tasks), task_rows)
            conn.execute(insert(executions), run_rows)
            conn.execute(insert(tool_calls), call_rows)
        with engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            conn.commit()
        yield engine


def plans_of(
    engine: Engine, scan: Callable[[Connection], Any], said: list[str] | None = None
) -> list[str]:
    """The plan of each query ``scan`` sends, as PostgreSQL would run it with its values (and,
    in ``said``, the queries' text)."""
    plans: list[str] = []

    def explain(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            if said is not None:
                said.append(statement)
            with conn.connection.dbapi_connection.cursor() as explaining:
                explaining.execute("EXPLAIN " + statement, parameters)
                plans.append("\n".join(row[0] for row in explaining.fetchall()))

    event.listen(engine, "before_cursor_execute", explain)
    try:
        with engine.connect() as conn:
            scan(conn)
    finally:
        event.remove(engine, "before_cursor_execute", explain)
    return plans


NOW = datetime.now(UTC)
STALL = timedelta(seconds=30)

SCANS: dict[str, Callable[[Connection], Any]] = {
    **{
        f"runs_due({reason})": (lambda r: lambda c: scans.runs_due(c, r, NOW, STALL, 100))(reason)
        for reason in (*scans.RUN_REASONS, scans.PROBE)
    },
    "abandoned_calls": lambda c: scans.abandoned_calls(c, NOW, 100),
    "overdue_calls": lambda c: scans.overdue_calls(c, NOW, 100),
    "lost_calls": lambda c: scans.lost_calls(c, NOW, STALL, 100),
    "orphaned_calls": lambda c: scans.orphaned_calls(c, NOW, STALL, 100),
    "tasks_past_timeout": lambda c: scans.tasks_past_timeout(c, NOW, 100),
    "fleet_gauges": lambda c: scans.fleet_gauges(c, NOW, STALL),
    "overdue_waits": lambda c: calls.overdue_waits(c, NOW - timedelta(days=1), NOW, 100),
    "waiters_on": lambda c: calls.waiters_on(c, "t97"),
    "held_until": lambda c: limits.held_until(c, NOW, NOW + timedelta(hours=2), 10),
    "runs_due(wake, held back)": lambda c: scans.runs_due(
        c, "wake", NOW, STALL, 100, held_back=STALL
    ),
    "task_page(status)": lambda c: reads.task_page(
        c, statuses=["running"], parent=None, limit=50, before=None
    ),
    "task_page(parent)": lambda c: reads.task_page(
        c, statuses=None, parent="t10", limit=50, before=None
    ),
    "subtree_spend": lambda c: spend.subtree_spend(c, "t10"),
    "children_count": lambda c: spend.children_count(c, "t10"),
}

#: the index a scan of a few rows among many must read (an index that holds many rows it
#: does not want, read whole, is no better than the table)
INDEXES = {
    "overdue_waits": ("ix_tool_calls_deadline_settled",),
    "waiters_on": ("ix_tool_calls_handle_set",),
    "orphaned_calls": ("ix_tool_calls_started_lease", "ix_tool_calls_open_deadline"),
    "runs_due(wake)": ("ix_executions_wake_set", "ix_executions_live_updated"),
}

#: what a scan must say as a literal, for the partial index that holds its rows
LITERALS = {
    "orphaned_calls": "tool_calls.state = 'started'",
    "overdue_waits": "tool_calls.outcome = 'deadline_exceeded'",
    "overdue_calls": "tool_calls.state != 'settled'",
    "lost_calls": "tool_calls.state != 'settled'",
    "abandoned_calls": "tool_calls.state != 'settled'",
    "fleet_gauges": "tool_calls.state != 'settled'",
    "runs_due(stalled)": "executions.phase != 'await_tools'",
}


@pytest.mark.parametrize("name", sorted(SCANS))
def test_a_scan_reads_an_index_not_the_history(history: Engine, name: str) -> None:
    said: list[str] = []
    plans = plans_of(history, SCANS[name], said)
    assert plans, f"{name} sent no query"
    for plan in plans:
        for table in TABLES:
            assert f"Seq Scan on {table}" not in plan, f"{name}:\n{plan}"
    if name in INDEXES:
        assert any(f"using {index} on" in plans[0] for index in INDEXES[name]), plans[0]
    if name in LITERALS:
        assert any(LITERALS[name] in statement for statement in said), (name, said)


def test_the_check_sees_a_sequential_scan(history: Engine) -> None:
    """What the test above looks for is what PostgreSQL prints for a scan of a whole table."""
    plans = plans_of(history, lambda c: c.execute(text("SELECT count(*) FROM tool_calls")))
    assert any("Seq Scan on tool_calls" in plan for plan in plans), plans
