"""The line of callers waiting for a provider limit's room (charlie/store/limits.py; I30), on
the real database with no workers: who a release wakes, what a waiter that leaves passes on,
and what place a run that waits again takes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Engine, select, update

from charlie import scheduler
from charlie.domain import Phase, utcnow
from charlie.store import limits
from charlie.store.engine import write
from charlie.store.schema import executions, limit_waiters
from tests.support.databases import own_database

KEY = "openai:"
GRACE = timedelta(seconds=1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A database of its own: the shared cluster's beat would sweep these rows."""
    with own_database(tmp_path_factory, "limit_waiters") as engine:
        yield engine


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A limit of the test's own."""
    return f"{KEY}{request.node.name[:60]}"


def a_run(engine: Engine, *, leased_until: datetime | None = None) -> tuple[str, str]:
    """A run at call_model (version 1), its lease held until ``leased_until`` (None: free);
    (task id, execution id)."""
    submitted = scheduler.submit(
        engine, prompt="wait", model="none", tools=None, task_id=None, timeout=None, metadata=None
    )
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == submitted.execution_id)
            .values(
                phase=Phase.CALL_MODEL.value,
                version=1,
                lease_owner=None if leased_until is None else "w1",
                lease_until=leased_until,
            )
        )
    return submitted.task_id, submitted.execution_id


def waits(engine: Engine, key: str, run: tuple[str, str], now: datetime, for_: float) -> int:
    """The run counts and records itself as a waiter, as FleetLimits does; how many wait
    ahead of it."""
    task_id, execution_id = run
    with write(engine) as conn:
        counted, priority, since = limits.count(conn, key, execution_id, task_id, now, GRACE)
        limits.wait(conn, key, execution_id, 1, priority, since, now, now + timedelta(seconds=for_))
    return counted.ahead


def a_slot(engine: Engine, key: str, now: datetime) -> int:
    holder = a_run(engine, leased_until=now + timedelta(minutes=5))
    with write(engine) as conn:
        return limits.take_slot(conn, key, holder[1], 1, 1, 0, now, waited=False)


def woken_by_release(engine: Engine, key: str, slot: int, now: datetime) -> list[str]:
    with write(engine) as conn:
        woken = limits.release(conn, key, slot, None, now, wake=1, woken_grace=GRACE)
    return [w.execution_id for w in woken]


def test_a_release_wakes_the_next_waiter_though_it_still_holds_its_lease(
    engine: Engine, key: str
) -> None:
    """I30: a release while the next in line is still committing its wait (its run's lease
    held) wakes it all the same, rather than skip it and leave the room idle until its own
    wake-up; once its wait is committed (its lease free), its process sees it was woken and
    looks again at once."""
    now = utcnow()
    slot = a_slot(engine, key, now)
    first = a_run(engine, leased_until=now + timedelta(seconds=30))
    second = a_run(engine)
    waits(engine, key, first, now, 60)
    waits(engine, key, second, now + timedelta(milliseconds=1), 60)
    later = now + timedelta(seconds=1)
    assert woken_by_release(engine, key, slot, later) == [first[1]]
    with write(engine) as conn:
        # still leased: not yet
        assert limits.woken_while_leased(conn, [first[1], second[1]], later) == []
        conn.execute(update(executions).where(executions.c.id == first[1]).values(lease_until=None))
        found = limits.woken_while_leased(conn, [first[1], second[1]], later)
    assert [w.execution_id for w in found] == [first[1]]
    # a wait written again clears the mark: that wait is not over
    waits(engine, key, first, later, 60)
    with write(engine) as conn:
        assert limits.woken_while_leased(conn, [first[1]], later) == []


def test_a_woken_waiter_that_leaves_passes_the_room_on(engine: Engine, key: str) -> None:
    """I30: the waiter a release woke leaves without taking the room (its task canceled,
    stopped, over budget): its wait ends and the next in line is woken for that room, not
    left asleep until its own wake-up."""
    now = utcnow()
    slot = a_slot(engine, key, now)
    first, second = a_run(engine), a_run(engine)
    waits(engine, key, first, now, 60)
    waits(engine, key, second, now + timedelta(milliseconds=1), 60)
    later = now + timedelta(milliseconds=10)
    assert woken_by_release(engine, key, slot, later) == [first[1]]
    with write(engine) as conn:
        woken = limits.leave(conn, first[1], later, GRACE)
        left = conn.execute(
            select(limit_waiters.c.execution_id).where(limit_waiters.c.execution_id == first[1])
        ).all()
    assert [w.execution_id for w in woken] == [second[1]]
    assert left == []  # its row ended with its wait


def test_a_run_that_waits_again_long_after_its_wait_ended_takes_a_new_place(
    engine: Engine, key: str
) -> None:
    """A run whose wait ended by itself (it failed or timed out while waiting, its row left
    to expire) and that is resumed does not find its old place in line: it goes behind
    those who waited meanwhile. A run renewing its wait in time keeps its place."""
    now = utcnow()
    old, other = a_run(engine), a_run(engine)
    assert waits(engine, key, old, now, 5) == 0
    assert waits(engine, key, other, now + timedelta(seconds=1), 120) == 1
    # in time: old keeps its place, ahead of other
    assert waits(engine, key, old, now + timedelta(seconds=2), 5) == 0
    # long after its row expired (the run resumed): behind other
    assert waits(engine, key, old, now + timedelta(seconds=30), 60) == 1
