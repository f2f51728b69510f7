"""A fused commit's statement (charlie/store/fused.py) writes nothing when the rows
are not as its steps assumed, whatever plan PostgreSQL picks for it, on the real database with
no workers: a task stopped meanwhile (I18), a call settled meanwhile (I12), a message sent
meanwhile (I22). The ordinary path then writes the steps, reading the rows as they are.

The plans are forced with ``join_collapse_limit = 1`` and the statement's final FROM list
turned around, so that the task's part is read first: a check that only the final SELECT reads
would then never run, and the statement would commit everything but it (a review found the
first version doing that).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, func, insert, select, update

from charlie import scheduler
from charlie.domain import CallState, Phase, TaskStatus, utcnow
from charlie.store import fused, runs
from charlie.store.engine import PREPARED, write, write_one
from charlie.store.schema import executions, tasks, tool_calls, transcript_items, transitions
from tests.conftest import BACKEND
from tests.support.databases import own_database

pytestmark = pytest.mark.skipif(
    not (BACKEND.database_url or "").startswith("postgresql"),
    reason="fused commits are PostgreSQL's (SQLite writes every step on its own)",
)

OWNER = "fused-statements@test"
FORWARD = "FROM run, checked, task_now t"
#: the final SELECT read task first: the plan a check read only there would not survive
TURNED = "FROM task_now t, checked, run"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with own_database(tmp_path_factory, "fused_statements") as engine:
        yield engine


@pytest.fixture(params=["planner's", "turned"])
def plan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "turned":
        original = fused._statement.__wrapped__

        def turned(*shape: bool) -> str:
            sql = original(*shape)
            assert FORWARD in sql
            return sql.replace(FORWARD, TURNED)

        monkeypatch.setattr(fused, "_statement", turned)
    return str(request.param)


def _run_at(engine: Engine, phase: Phase, *, leased: bool) -> runs.Claim:
    submitted = scheduler.submit(
        engine, prompt="fused", model="none", tools=None, task_id=None, timeout=None, metadata=None
    )
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == submitted.execution_id)
            .values(
                phase=phase.value,
                version=7,
                turn=1,
                next_seq=2,
                lease_owner=OWNER if leased else None,
                lease_until=utcnow() + timedelta(seconds=30) if leased else None,
                attempts=1 if leased else 0,
            )
        )
        conn.execute(update(tasks).where(tasks.c.id == submitted.task_id).values(status="running"))
    return runs.Claim(
        submitted.execution_id, submitted.task_id, phase, 7, 1, 2, {}, 1, None, None, 0
    )


def _commit(engine: Engine, commit: fused.FusedCommit, forced: bool) -> runs.Fresh | None:
    with write_one(engine) as conn:
        if forced:
            conn.exec_driver_sql("SET join_collapse_limit = 1")
            conn.exec_driver_sql("SET from_collapse_limit = 1")
        try:
            return fused.commit_fused(conn, commit)
        finally:
            conn.exec_driver_sql("RESET join_collapse_limit")
            conn.exec_driver_sql("RESET from_collapse_limit")


def _written(engine: Engine, claim: runs.Claim) -> tuple[object, ...]:
    xid = claim.execution_id
    with engine.connect() as conn:
        run = conn.execute(
            select(executions.c.phase, executions.c.version, executions.c.lease_owner).where(
                executions.c.id == xid
            )
        ).one()
        counts = [
            conn.execute(select(func.count()).where(table.c.execution_id == xid)).scalar_one()
            for table in (transitions, transcript_items)
        ]
        tokens = conn.execute(
            select(tasks.c.output_tokens).where(tasks.c.id == claim.task_id)
        ).scalar_one()
    return (tuple(run), *counts, tokens)


def _model_turn(claim: runs.Claim) -> fused.FusedCommit:
    """A's shape: call_model's result (an item, a call started here) with its dispatch."""
    now = utcnow()
    call = {
        "call_id": "c", "idx": 0, "name": "echo", "arguments": {"v": 1}, "effect": "read",
        "resumable": False, "state": "started", "attempts": 1, "outcome": None, "result": None,
        "settled_at": None, "settled_by": None, "hold": None, "hold_info": None,
        "on_interrupt": None, "queued_at": now, "dispatch_version": 8,
        "deadline_at": now + timedelta(seconds=60), "started_at": now, "started_by": OWNER,
        "lease_owner": OWNER, "lease_until": now + timedelta(seconds=30), "implementation": "x",
    }  # fmt: skip
    return fused.FusedCommit(
        run=fused.RunBefore(claim.execution_id, claim.task_id, Phase.CALL_MODEL, 7, OWNER),
        after=fused.RunAfter(Phase.AWAIT_TOOLS, 2, 0, 1, None, 1, 0, None),
        owner=OWNER,
        now=now,
        records=[
            fused.Record(Phase.CALL_MODEL, Phase.DISPATCH_TOOLS, 8, now, 1.0, None),
            fused.Record(Phase.DISPATCH_TOOLS, Phase.AWAIT_TOOLS, 9, now, 1.0, None),
        ],
        turn=1,
        task_status="running",
        task_timeout_at=None,
        task_write=fused.TaskWrite(output_tokens=5),
        items=[(2, "tool_call", "c", {"name": "echo", "arguments": {"v": 1}})],
        calls=[call],
    )


def test_a_task_stopped_meanwhile_writes_nothing(engine: Engine, plan: str) -> None:
    """I18: the model's result and its dispatch do not land for a task canceled during the
    model call; the ordinary path's boundary then stops the run."""
    claim = _run_at(engine, Phase.CALL_MODEL, leased=True)
    before = _written(engine, claim)
    scheduler.cancel(engine, claim.task_id)
    assert _commit(engine, _model_turn(claim), plan == "turned") is None
    assert _written(engine, claim) == before
    with engine.connect() as conn:
        count = conn.execute(
            select(func.count()).where(tool_calls.c.execution_id == claim.execution_id)
        ).scalar_one()
    assert count == 0
    # ...and the same commit for a task still running goes through, on the same plan
    claim = _run_at(engine, Phase.CALL_MODEL, leased=True)
    fresh = _commit(engine, _model_turn(claim), plan == "turned")
    assert fresh is not None and fresh.status == TaskStatus.RUNNING.value
    assert _written(engine, claim) == (("await_tools", 9, None), 2, 1, 5)


def _settle_turn(claim: runs.Claim, turn_calls: int = 1) -> fused.FusedCommit:
    """B's shape: the local call's settle, await_tools and advance_turn, the model's claim."""
    now = utcnow()
    return fused.FusedCommit(
        run=fused.RunBefore(
            claim.execution_id, claim.task_id, Phase.AWAIT_TOOLS, 7, None, 0, 0, 1, 2, {}
        ),
        after=fused.RunAfter(Phase.CALL_MODEL, 2, 1, 1, None, 0, 0, now + timedelta(seconds=30)),
        owner=OWNER,
        now=now,
        records=[
            fused.Record(Phase.AWAIT_TOOLS, Phase.ADVANCE_TURN, 8, now, 1.0, None),
            fused.Record(Phase.ADVANCE_TURN, Phase.CALL_MODEL, 9, now, 1.0, None),
        ],
        turn=1,
        task_status="running",
        task_timeout_at=None,
        items=[(2, "tool_result", "c", {"name": "echo", "outcome": "ok", "result": "r"})],
        settles=[fused.Settle("c", "ok", "r", 1.0, 1, 1, now)],
        turn_calls=turn_calls,
    )


def _started_call(engine: Engine, claim: runs.Claim) -> None:
    now = utcnow()
    with write(engine) as conn:
        conn.execute(
            insert(tool_calls).values(
                execution_id=claim.execution_id,
                call_id="c",
                turn=1,
                idx=0,
                name="echo",
                arguments={},
                effect="read",
                resumable=False,
                state=CallState.STARTED.value,
                attempts=1,
                late_reports=0,
                queued_at=now,
                started_at=now,
                started_by=OWNER,
                lease_owner=OWNER,
                lease_until=now + timedelta(seconds=30),
                deadline_at=now + timedelta(seconds=60),
            )
        )


def test_a_call_settled_meanwhile_writes_nothing(engine: Engine, plan: str) -> None:
    """I12: a deadline (or a sweep) settled the call while its handler ran: the worker's
    result does not land, nor the turn's advance; the ordinary path records a late report."""
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    with write(engine) as conn:
        conn.execute(
            update(tool_calls)
            .where(tool_calls.c.execution_id == claim.execution_id)
            .values(state="settled", outcome="deadline_exceeded", settled_by="sweep")
        )
    before = _written(engine, claim)
    assert _commit(engine, _settle_turn(claim), plan == "turned") is None
    assert _written(engine, claim) == before
    with engine.connect() as conn:
        call = conn.execute(
            select(tool_calls.c.outcome, tool_calls.c.finish_order).where(
                tool_calls.c.execution_id == claim.execution_id
            )
        ).one()
    assert tuple(call) == ("deadline_exceeded", None)


def test_a_message_sent_meanwhile_writes_nothing(engine: Engine, plan: str) -> None:
    """I22: a message committed while the call ran is taken in at this boundary by the
    ordinary path (it reads the mailbox), not skipped by a commit that assumed none."""
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == claim.execution_id)
            .values(inbox=executions.c.inbox + 1)
        )
    before = _written(engine, claim)
    assert _commit(engine, _settle_turn(claim), plan == "turned") is None
    assert _written(engine, claim) == before
    # and with the turn's calls as predicted, it goes through
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    assert _commit(engine, _settle_turn(claim), plan == "turned") is not None
    assert _written(engine, claim) == (("call_model", 9, OWNER), 2, 1, 0)


def test_a_turn_with_a_call_not_predicted_writes_nothing(engine: Engine, plan: str) -> None:
    """The turn has a call the worker did not know of: its result would be missing (I8)."""
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    before = _written(engine, claim)
    assert _commit(engine, _settle_turn(claim, turn_calls=2), plan == "turned") is None
    assert _written(engine, claim) == before


def _call_state(engine: Engine, claim: runs.Claim) -> tuple[object, ...]:
    with engine.connect() as conn:
        row = conn.execute(
            select(tool_calls.c.state, tool_calls.c.outcome, tool_calls.c.settled_by).where(
                tool_calls.c.execution_id == claim.execution_id
            )
        ).one()
    return tuple(row)


def test_a_task_canceled_before_the_turns_last_settle_writes_nothing(
    engine: Engine, plan: str
) -> None:
    """I18: B (the last call's settle carrying await_tools, advance_turn and the next model
    call's claim) for a task canceled while the call ran lands nothing: no result item, no
    advance, no claim of call_model; the ordinary path then settles the call and stops the run
    at its boundary."""
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    scheduler.cancel(engine, claim.task_id)
    before = _written(engine, claim)
    assert _commit(engine, _settle_turn(claim), plan == "turned") is None
    assert _written(engine, claim) == before
    assert _call_state(engine, claim) == ("started", None, None)


def test_a_cancel_that_commits_while_the_turns_last_settle_waits_is_seen(engine: Engine) -> None:
    """I18, the share-lock path: a cancel holds the task's row when B starts; B waits on its
    share lock of the task and, once the cancel commits, reads the task canceled and writes
    nothing (the statement's snapshot said running)."""
    claim = _run_at(engine, Phase.AWAIT_TOOLS, leased=False)
    _started_call(engine, claim)
    before = _written(engine, claim)
    out: list[object] = []
    with engine.connect() as canceler:
        trans = canceler.begin()
        canceler.execute(
            update(tasks)
            .where(tasks.c.id == claim.task_id)
            .values(status=TaskStatus.CANCELED.value)
        )
        thread = threading.Thread(
            target=lambda: out.append(_commit(engine, _settle_turn(claim), False)), daemon=True
        )
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "B did not wait for the cancel's lock on the task"
        trans.commit()
    thread.join(10)
    assert out == [None]
    assert _written(engine, claim) == before
    assert _call_state(engine, claim) == ("started", None, None)


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata", "America/St_Johns"])
@pytest.mark.parametrize(
    ("timeout_at", "budget"),
    [
        (
            "2026-12-06 12:00:00.12345+00",
            '{"usd": 0.5, "tokens": 1000, "n": {"a": [1, 2.5, null]}}',
        ),
        ("2026-12-06 12:00:00+00", "null"),
        (None, None),
    ],
)
def test_the_values_a_commit_returns_read_as_their_columns_would(
    engine: Engine, zone: str, timeout_at: str | None, budget: str | None
) -> None:
    """What a fused commit returns of its run and task (one JSON array, runs.Fresh) is what the
    same values read as columns are: the same instant of a timeout to the microsecond whatever
    the session's time zone (the next commit compares it with the task's, I18), the same
    budget (I31), token counts and flag."""
    values = (
        "SELECT 3 AS inbox, 4 AS model_calls, 'running'::varchar AS status, "
        "CAST(%(timeout)s AS timestamptz) AS timeout_at, CAST(%(budget)s AS jsonb) AS budget, "
        "10 AS input_tokens, 20 AS output_tokens, 30 AS reasoning_tokens, "
        "40 AS cache_read_tokens, 50 AS cache_write_tokens, true AS delegated"
    )
    params = {"timeout": timeout_at, "budget": budget}
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SET TIME ZONE '{zone}'")
        as_columns = conn.exec_driver_sql(values, params).one()
        as_array = conn.exec_driver_sql(
            f"SELECT {fused._fresh_array('v', 'v', 'v.delegated')} FROM ({values}) v", params
        ).scalar_one()
        conn.rollback()
    got = fused._fresh(as_array, "t1")
    assert got == runs.Fresh(
        3,
        4,
        "running",
        as_columns.timeout_at,
        as_columns.budget,
        "t1",
        (10, 20, 30, 40, 50),
        delegated=True,
    )
    if got.timeout_at is not None:
        assert got.timeout_at.utcoffset() == timedelta(0)
        assert got.timeout_at.microsecond == as_columns.timeout_at.microsecond


def test_a_column_type_changed_by_a_migration_leaves_prepared_commits_working(
    engine: Engine,
) -> None:
    """A rolling upgrade (docs/production/pgbouncer.md): a migration run while old workers are
    up may change the type of a column a fused commit reads and returns (here the run's
    ``inbox``, integer to bigint). A statement prepared on the server whose result's types
    would change by it fails with 0A000 ("cached plan must not change result type") at every
    later execution on that connection; the fused commit returns one JSON array, whose type
    does not change, so the connection's next turn commits (I3: the run goes on)."""
    first = _run_at(engine, Phase.CALL_MODEL, leased=True)
    second = _run_at(engine, Phase.CALL_MODEL, leased=True)
    with write_one(engine) as conn:
        assert conn.info[PREPARED] is True  # a direct connection: the commit is prepared
        assert fused.commit_fused(conn, _model_turn(first)) is not None
        # (the module's earlier tests may have prepared other shapes on this connection)
        prepared = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH run AS %%'"
        )
        assert prepared.scalar_one() >= 1
        with engine.connect() as other:  # (another connection: this one is checked out)
            other.exec_driver_sql("ALTER TABLE executions ALTER COLUMN inbox TYPE bigint")
            other.commit()
        try:
            fresh = fused.commit_fused(conn, _model_turn(second))
        finally:
            with engine.connect() as other:
                other.exec_driver_sql("ALTER TABLE executions ALTER COLUMN inbox TYPE integer")
                other.commit()
    assert fresh is not None and fresh.inbox == 0
    assert _written(engine, second) == _written(engine, first)
