"""A call's claim against a concurrent cancel, on the real database, with no workers (I18).

A cancel must never be followed by a call of its task starting: either the claim committed
first (and the cancel's recorded time is later than the start), or the claim sees the task
stopped. Each test holds one side's transaction open on its own connection and runs the other
in a thread; the database's locks (PostgreSQL's row locks, SQLite's write lock) decide the order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.engine import make_url

from charlie import scheduler
from charlie.domain import CallState, TaskStatus, utcnow
from charlie.store import calls
from charlie.store.engine import get_engine, upgrade, write
from charlie.store.schema import tasks, tool_calls
from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import recreate_postgres_database

#: how long the thread must stay blocked to count as waiting for the held transaction.
BLOCKED_FOR = 0.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A database of its own: the shared cluster's beat would sweep these rows."""
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    if BACKEND.database_url and BACKEND.database_url.startswith("postgresql"):
        url = make_url(BACKEND.database_url)
        url = url.set(database=f"{url.database}_claim_races").render_as_string(hide_password=False)
        recreate_postgres_database(url)
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('races') / 'charlie.db'}"
    upgrade(url)
    engine = get_engine(url)
    yield engine
    engine.dispose()


def queued_call(engine: Engine) -> tuple[str, str]:
    """A task whose turn 0 holds one queued, not yet started call; (task id, execution id)."""
    submitted = scheduler.submit(
        engine, prompt="race", model="none", tools=None, task_id=None, timeout=None, metadata=None
    )
    with write(engine) as conn:
        conn.execute(
            insert(tool_calls).values(
                execution_id=submitted.execution_id,
                call_id="c1",
                turn=0,
                idx=0,
                name="echo",
                arguments={},
                effect="read",
                resumable=False,
                state=CallState.PENDING.value,
                queued_at=utcnow(),
                attempts=0,
                late_reports=0,
            )
        )
    return submitted.task_id, submitted.execution_id


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def call_row(engine: Engine, execution_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(tool_calls).where(tool_calls.c.execution_id == execution_id)
        ).one()


def task_row(engine: Engine, task_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(tasks).where(tasks.c.id == task_id)).one()


def test_a_claim_during_an_uncommitted_cancel_waits_and_then_starts_nothing(
    engine: Engine,
) -> None:
    """I18: the claim's snapshot still shows the task active; the held task row makes it wait
    for the cancel, after which it sees the task stopped and rolls back."""
    task_id, execution_id = queued_call(engine)
    with engine.connect() as canceller:
        canceller.begin()
        canceller.execute(
            update(tasks).where(tasks.c.id == task_id).values(status=TaskStatus.CANCELED.value)
        )
        thread, claimed = in_thread(
            lambda: calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0)
        )
        thread.join(BLOCKED_FOR)
        assert thread.is_alive(), f"the claim did not wait for the cancel: {claimed}"
        canceller.commit()
    thread.join(10)
    assert claimed == [None]
    row = call_row(engine, execution_id)
    assert (row.state, row.started_at, row.attempts) == (CallState.PENDING.value, None, 0)


def test_a_cancel_during_an_uncommitted_claim_waits_and_records_a_later_time(
    engine: Engine,
) -> None:
    """I18: a claim that got the task first is in flight at the cancel, and the cancel's
    recorded time says so: it is not earlier than the start."""
    task_id, execution_id = queued_call(engine)
    with engine.connect() as claimer:
        claimer.begin()
        claim = calls.claim_call(claimer, execution_id, 0, "c1", "start", "w-test", utcnow(), 5.0)
        assert claim is not None
        thread, canceled = in_thread(lambda: scheduler.cancel(engine, task_id))
        thread.join(BLOCKED_FOR)
        assert thread.is_alive(), f"the cancel did not wait for the claim: {canceled}"
        claimer.commit()
    thread.join(10)
    assert canceled == [[task_id]]
    call, task = call_row(engine, execution_id), task_row(engine, task_id)
    assert call.state == CallState.STARTED.value
    assert task.status == TaskStatus.CANCELED.value
    assert task.finished_at >= call.started_at


def test_a_claim_after_a_committed_cancel_starts_nothing(engine: Engine) -> None:
    """I18: the plain case, for completeness: nothing to wait for, nothing claimed."""
    task_id, execution_id = queued_call(engine)
    assert scheduler.cancel(engine, task_id) == [task_id]
    assert calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0) is None
    assert call_row(engine, execution_id).state == CallState.PENDING.value
