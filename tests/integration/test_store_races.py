"""Races between writers of one run, on the real database, with no workers.

- A call's claim against a concurrent cancel (I18): a cancel is never followed by a call of its
  task starting: either the claim committed first (and the cancel's recorded time is later than
  the start), or the claim sees the task stopped.
- The sweep settling a turn's last call while a worker settles the one before (I7): one of them
  always sees the turn complete and moves the run on. (On SQLite the write lock already
  orders them; on PostgreSQL the run's row lock does.)

Each test holds one side's transaction open on its own connection and runs the other in a
thread; the database's locks (PostgreSQL's row locks, SQLite's write lock) decide the order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast

import pytest
from sqlalchemy import Engine, insert, select, update

from charlie import scheduler
from charlie.config import settings
from charlie.domain import CallState, Phase, TaskStatus, utcnow
from charlie.runtime import Publisher, Runtime
from charlie.store import calls, runs, scans
from charlie.store.engine import write
from charlie.store.schema import executions, tasks, tool_calls
from charlie.sweeps import sweep_tool_calls
from charlie.testing import RecordingPublisher
from charlie.tools.registry import ToolRegistry
from tests.support.databases import own_database

#: how long the thread must stay blocked to count as waiting for the held transaction.
BLOCKED_FOR = 0.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A database of its own: the shared cluster's beat would sweep these rows."""
    # The schema is this module's alone: its sweeps must see only the rows these tests made.
    with own_database(tmp_path_factory, "claim_races") as engine:
        yield engine


def queued_call(engine: Engine, **overrides: Any) -> tuple[str, str]:
    """A task whose turn 0 holds one queued, not yet started call; (task id, execution id)."""
    submitted = scheduler.submit(
        engine, prompt="race", model="none", tools=None, task_id=None, timeout=None, metadata=None
    )
    add_call(engine, submitted.execution_id, "c1", **overrides)
    return submitted.task_id, submitted.execution_id


def add_call(engine: Engine, execution_id: str, call_id: str, **overrides: Any) -> None:
    with write(engine) as conn:
        conn.execute(
            insert(tool_calls).values(
                {
                    "execution_id": execution_id,
                    "call_id": call_id,
                    "turn": 0,
                    "idx": int(call_id[1:]),
                    "name": "echo",
                    "arguments": {},
                    "effect": "read",
                    "resumable": False,
                    "state": CallState.PENDING.value,
                    "queued_at": utcnow(),
                    "attempts": 0,
                    "late_reports": 0,
                    **overrides,
                }
            )
        )


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``work`` in a thread; its result (or the exception it raised) lands in the list."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(work())
        except Exception as error:
            out.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def waiting(work: Callable[[], Any], failure: str) -> tuple[threading.Thread, list[Any]]:
    """Start ``work`` in a thread and check it is blocked (on the other side's lock)."""
    thread, out = in_thread(work)
    thread.join(BLOCKED_FOR)
    assert thread.is_alive(), f"{failure}: {out}"
    return thread, out


def call_row(engine: Engine, execution_id: str, call_id: str = "c1") -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(tool_calls).where(
                tool_calls.c.execution_id == execution_id, tool_calls.c.call_id == call_id
            )
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
        thread, claimed = waiting(
            lambda: calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0),
            "the claim did not wait for the cancel",
        )
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
        thread, canceled = waiting(
            lambda: scheduler.cancel(engine, task_id), "the cancel did not wait for the claim"
        )
        claimer.commit()
    thread.join(10)
    assert canceled == [[task_id]]
    call, task = call_row(engine, execution_id), task_row(engine, task_id)
    assert call.state == CallState.STARTED.value
    assert task.status == TaskStatus.CANCELED.value
    assert task.finished_at >= call.started_at


def test_a_cancel_takes_its_time_once_the_claim_holding_the_task_committed(
    engine: Engine,
) -> None:
    """I18, the dispatch's local call: it holds the task first and takes its start time
    afterwards; the cancel, waiting meanwhile, records a time after that start."""
    task_id, execution_id = queued_call(engine)
    with engine.connect() as claimer:
        claimer.begin()
        assert calls.hold_live_task(claimer, task_id, utcnow())
        thread, canceled = waiting(
            lambda: scheduler.cancel(engine, task_id), "the cancel did not wait for the held task"
        )
        claim = calls.claim_call(
            claimer, execution_id, 0, "c1", "start", "w-test", utcnow(), 5.0, task_held=True
        )
        assert claim is not None
        claimer.commit()
    thread.join(10)
    assert canceled == [[task_id]]
    call, task = call_row(engine, execution_id), task_row(engine, task_id)
    assert task.finished_at >= call.started_at


def test_the_local_call_of_a_dispatch_racing_a_cancel_starts_nothing(engine: Engine) -> None:
    """I18, the dispatch's local call: started inside the dispatch's transaction, it waits for
    a cancel being written and then starts nothing, without failing that transaction."""
    task_id, execution_id = queued_call(engine)

    def dispatch() -> Any:
        with write(engine) as conn:
            return calls.start_local_call(conn, execution_id, 0, "c1", "w-test", 5.0)

    with engine.connect() as canceller:
        canceller.begin()
        canceller.execute(
            update(tasks).where(tasks.c.id == task_id).values(status=TaskStatus.CANCELED.value)
        )
        thread, started = waiting(dispatch, "the local call did not wait for the cancel")
        canceller.commit()
    thread.join(10)
    assert started == [None]
    assert call_row(engine, execution_id).state == CallState.PENDING.value


def test_no_call_starts_once_its_task_is_past_its_timeout(engine: Engine) -> None:
    """I18: a timed-out task stops calls before the sweep records the timeout."""
    task_id, execution_id = queued_call(engine)
    with write(engine) as conn:
        conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(timeout_at=utcnow() - timedelta(seconds=1))
        )
    assert calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0) is None
    assert call_row(engine, execution_id).state == CallState.PENDING.value


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "stepwise"])
def test_a_turns_calls_claimed_together_during_a_cancel_start_none(
    engine: Engine, fused: bool
) -> None:
    """I18, I9: the calls of a turn run at once are started in one claim; one that waited for
    a cancel being written starts none of them, and every one stays pending."""
    task_id, execution_id = queued_call(engine)
    add_call(engine, execution_id, "c2")
    with engine.connect() as canceller:
        canceller.begin()
        canceller.execute(
            update(tasks).where(tasks.c.id == task_id).values(status=TaskStatus.CANCELED.value)
        )
        thread, started = waiting(
            lambda: calls.claim_calls_alone(
                engine, execution_id, 0, ("c1", "c2"), "w-test", 5.0, fused=fused
            ),
            "the claim did not wait for the cancel",
        )
        canceller.commit()
    thread.join(10)
    assert started == [()]
    for call_id in ("c1", "c2"):
        assert call_row(engine, execution_id, call_id).state == CallState.PENDING.value


def test_a_child_submitted_during_its_parents_cancel_is_refused(engine: Engine) -> None:
    """I18, delegation: the child's submit holds the parent's row, so it waits for the cancel
    being written and then refuses, rather than start a child the cancel never saw."""
    parent_id, _ = queued_call(engine)
    with engine.connect() as canceller:
        canceller.begin()
        canceller.execute(
            update(tasks).where(tasks.c.id == parent_id).values(status=TaskStatus.CANCELED.value)
        )
        thread, submitted = waiting(
            lambda: submit_child(engine, parent_id),
            "the child's submit did not wait for the cancel",
        )
        canceller.commit()
    thread.join(10)
    assert len(submitted) == 1 and isinstance(submitted[0], scheduler.ParentStopped)
    with engine.connect() as conn:
        children = conn.execute(select(tasks.c.id).where(tasks.c.parent_id == parent_id)).all()
    assert children == []


def test_a_cancel_during_a_childs_submit_waits_and_cancels_the_child(engine: Engine) -> None:
    """I18, delegation: the other order: the cancel waits for the submit holding the parent,
    then finds the new child and cancels it with its parent."""
    parent_id, _ = queued_call(engine)
    with engine.connect() as submitter:
        submitter.begin()
        assert calls.hold_live_task(submitter, parent_id, utcnow())
        thread, canceled = waiting(
            lambda: scheduler.cancel(engine, parent_id),
            "the cancel did not wait for the child's submit",
        )
        submitter.execute(insert(tasks).values(child_row(parent_id)))
        submitter.commit()
    thread.join(10)
    assert canceled == [[parent_id, f"{parent_id}.child"]]
    assert task_row(engine, f"{parent_id}.child").status == TaskStatus.CANCELED.value


def test_the_same_child_submitted_again_after_its_parents_cancel_is_that_child(
    engine: Engine,
) -> None:
    """I19, I18: a delegate recovered after its parent was canceled submits its child again:
    the child the first submit made (and the cancel stopped) is returned, not refused; a child
    that was never made is still refused, and a different one under the same id conflicts."""
    parent_id, _ = queued_call(engine)
    first = submit_child(engine, parent_id)
    assert first.created
    assert scheduler.cancel(engine, parent_id) == [parent_id, first.task_id]
    again = submit_child(engine, parent_id)
    assert again == scheduler.Submitted(first.task_id, first.execution_id, created=False)
    assert task_row(engine, first.task_id).status == TaskStatus.CANCELED.value
    with pytest.raises(scheduler.ParentStopped):
        scheduler.submit(
            engine,
            prompt="child",
            model="none",
            tools=None,
            task_id=f"{parent_id}.another",
            timeout=None,
            metadata=None,
            parent_id=parent_id,
        )
    with pytest.raises(scheduler.TaskConflict):
        scheduler.submit(
            engine,
            prompt="other work",
            model="none",
            tools=None,
            task_id=first.task_id,
            timeout=None,
            metadata=None,
            parent_id=parent_id,
        )


def submit_child(engine: Engine, parent_id: str) -> scheduler.Submitted:
    return scheduler.submit(
        engine,
        prompt="child",
        model="none",
        tools=None,
        task_id=f"{parent_id}.child",
        timeout=None,
        metadata=None,
        parent_id=parent_id,
    )


def child_row(parent_id: str) -> dict[str, Any]:
    """The row scheduler.submit writes for a child, written here inside a held transaction."""
    return {
        "id": f"{parent_id}.child",
        "parent_id": parent_id,
        "prompt": "child",
        "model": "none",
        "metadata": {},
        "status": TaskStatus.QUEUED.value,
        "created_at": utcnow(),
        "input_tokens": 0,
        "output_tokens": 0,
        "reasoning_tokens": 0,
    }


def test_a_claim_after_a_committed_cancel_starts_nothing(engine: Engine) -> None:
    """I18: the plain case, for completeness: nothing to wait for, nothing claimed."""
    task_id, execution_id = queued_call(engine)
    assert scheduler.cancel(engine, task_id) == [task_id]
    assert calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0) is None
    assert call_row(engine, execution_id).state == CallState.PENDING.value


def test_the_sweep_settling_the_last_call_sees_the_worker_settling_the_one_before(
    engine: Engine,
) -> None:
    """I7: a worker has settled c1 and counted c2 still open, uncommitted; the sweep settles
    c2 (past its deadline). It waits for the worker's run lock, then sees the whole turn
    settled and publishes the run's await tick, instead of both missing the turn's end."""
    now = utcnow()
    live_lease = {"lease_owner": "w-live", "lease_until": now + timedelta(minutes=5)}
    started = {"state": CallState.STARTED.value, "started_at": now, **live_lease}
    _, execution_id = queued_call(engine, **started)
    add_call(engine, execution_id, "c2", deadline_at=now - timedelta(seconds=1), **started)
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == execution_id)
            .values(phase=Phase.AWAIT_TOOLS.value, version=3)
        )
    publisher = RecordingPublisher()
    rt = Runtime(
        settings=settings(),
        engine=engine,
        worker="sweeper-test",
        publisher=cast(Publisher, publisher),
        tools=ToolRegistry(),
    )
    with engine.connect() as worker:
        worker.begin()
        assert calls.lock_run(worker, execution_id) == (Phase.AWAIT_TOOLS.value, 3)
        assert calls.settle_call(worker, execution_id, 0, "c1", "ok", {}, "w-live", utcnow())
        assert calls.count_unsettled(worker, execution_id, 0) == 1  # c2: the sweep's, not yet
        thread, swept = waiting(
            lambda: sweep_tool_calls(rt), "the sweep did not wait for the worker's run lock"
        )
        worker.commit()
    thread.join(10)
    assert swept[0]["deadline"] == 1
    assert call_row(engine, execution_id, "c2").outcome == "deadline_exceeded"
    assert publisher.ticks == [(execution_id, Phase.AWAIT_TOOLS, 3)]
    # I4: and it stored the run's wake-up, a stall period ahead, should that tick be lost
    with engine.connect() as conn:
        wake = conn.execute(
            select(executions.c.wake_at).where(executions.c.id == execution_id)
        ).scalar_one()
    assert wake is not None and wake > now


def test_a_refused_tick_after_a_committed_claim_leaves_its_run_a_wake_up(engine: Engine) -> None:
    """I4: a committed (durable) claim clears the run's wake-up, as every claim does; when the
    tick's own writes are then refused, the run is freed with a wake-up a stall period ahead,
    which the sweeps' wake scan finds: a run in await_tools is found by no other scan of a
    round."""
    _, execution_id = queued_call(engine)
    with write(engine) as conn:
        conn.execute(
            update(executions)
            .where(executions.c.id == execution_id)
            .values(
                phase=Phase.AWAIT_TOOLS.value,
                version=4,
                lease_owner="w1",
                lease_until=utcnow() + timedelta(minutes=5),
                wake_at=None,
            )
        )
    recheck = utcnow() + timedelta(seconds=5)
    with write(engine) as conn:
        runs.record_refused_tick(
            conn, execution_id, 4, "w1", {"message": "refused"}, claim_committed=True,
            recheck_at=recheck,
        )  # fmt: skip
    with engine.connect() as conn:
        row = conn.execute(
            select(executions.c.lease_owner, executions.c.wake_at).where(
                executions.c.id == execution_id
            )
        ).one()
        assert (row.lease_owner, row.wake_at) == (None, recheck)
        due = scans.runs_due(conn, "wake", recheck, timedelta(seconds=5), 100)
    assert execution_id in {r.id for r in due}


#: Held calls as the code leaves them, each with the claim mode that would take it were it not
#: held: a write waiting for approval (queued, never started); a parked question
#: (calls.park_for_answer: started, resumable, no owner, no lease); an interrupted call held for
#: a verdict (calls.hold_for_reconcile: started, no owner, no lease), resumable or not, and one
#: whose lapsed lease was left on it (a holder that stopped before the hold cleared it).
HELD_SHAPES: dict[str, tuple[dict[str, Any], str | None]] = {
    "approval": ({"hold": "approval"}, "start"),
    "parked question": (
        {"hold": "reply", "state": CallState.STARTED.value, "started_at": utcnow(),
         "started_by": "w-gone", "resumable": True, "lease_owner": None, "lease_until": None},
        "resume",
    ),
    "interrupted, resumable": (
        {"hold": "reconcile", "state": CallState.STARTED.value, "started_at": utcnow(),
         "started_by": "w-gone", "resumable": True, "lease_owner": None, "lease_until": None},
        "resume",
    ),
    "interrupted, lapsed lease": (
        {"hold": "reconcile", "state": CallState.STARTED.value, "started_at": utcnow(),
         "started_by": "w-gone", "lease_owner": "w-gone",
         "lease_until": utcnow() - timedelta(minutes=1)},
        "reconcile",
    ),
}  # fmt: skip

MODES: tuple[calls.Mode, ...] = ("start", "resume", "reconcile")


def _claim_every_way(engine: Engine, execution_id: str, mode: calls.Mode) -> list[object]:
    """The call claimed by every path a worker takes: alone (one statement on PostgreSQL, and
    step by step), inside a tick's transaction holding the task, and with its turn's calls."""
    got: list[object] = []
    for fused in (True, False):
        got.append(calls.claim_call_alone(
            engine, execution_id, 0, "c1", mode, "w-test", 5.0, fused=fused
        ))  # fmt: skip
    with write(engine) as conn:
        got.append(calls.claim_call(
            conn, execution_id, 0, "c1", mode, "w-test", utcnow(), 5.0, task_held=True
        ))  # fmt: skip
        conn.rollback()
    if mode == "start":
        for fused in (True, False):
            got += calls.claim_calls_alone(
                engine, execution_id, 0, ("c1", "c2"), "w-test", 5.0, fused=fused
            )
    return [c for c in got if c is not None and getattr(c, "call_id", "c1") == "c1"]


@pytest.mark.parametrize("shape", list(HELD_SHAPES))
def test_no_claim_starts_a_call_held_for_a_person(engine: Engine, shape: str) -> None:
    """I23: a stray or redelivered invoke never starts or takes over a held call, in any mode
    and by any claim path: only a verdict releases it (the claim's `hold IS NULL`). The same
    row without its hold is claimed (so the row is claimable but for its hold)."""
    overrides, claimed_by = HELD_SHAPES[shape]
    deadline = {"deadline_at": utcnow() + timedelta(hours=1)}
    _, execution_id = queued_call(engine, **deadline, **overrides)
    add_call(engine, execution_id, "c2", hold="approval", **deadline)
    before = call_row(engine, execution_id)
    for mode in MODES:
        assert _claim_every_way(engine, execution_id, mode) == [], f"{shape}: {mode} claimed it"
    after = call_row(engine, execution_id)
    assert (after.state, after.started_at, after.started_by, after.lease_owner, after.attempts) == (
        before.state, before.started_at, before.started_by, before.lease_owner, before.attempts
    )  # fmt: skip
    # the control: released, the same row is taken by the mode that takes its kind
    with write(engine) as conn:
        conn.execute(
            update(tool_calls)
            .where(tool_calls.c.execution_id == execution_id, tool_calls.c.call_id == "c1")
            .values(hold=None)
        )
    assert claimed_by is not None
    assert calls.claim_call_alone(engine, execution_id, 0, "c1", claimed_by, "w-test", 5.0)


def test_a_call_past_its_deadline_is_not_started(engine: Engine) -> None:
    """I13: a call still queued when its deadline passed settles deadline_exceeded as never
    started; no worker starts it late."""
    _, execution_id = queued_call(engine, deadline_at=utcnow() - timedelta(seconds=1))
    assert calls.claim_call_alone(engine, execution_id, 0, "c1", "start", "w-test", 5.0) is None
    assert call_row(engine, execution_id).started_at is None
    _, fresh = queued_call(engine, deadline_at=utcnow() + timedelta(minutes=5))
    assert calls.claim_call_alone(engine, fresh, 0, "c1", "start", "w-test", 5.0) is not None


def test_in_a_backlog_a_settled_turns_wake_up_waits_as_a_stalled_run_does(engine: Engine) -> None:
    """I4 without a feedback loop: in a broker backlog the wake-up a completing settle stored
    (a run in await_tools) is mostly an await tick still queued, so the wake scan holds it back
    as long as the stalled scan holds a quiet run; any other wake-up (a backoff, a limit's
    wait) goes at once."""
    now = utcnow()
    wakes = {}
    for phase in (Phase.AWAIT_TOOLS, Phase.CALL_MODEL):
        _, execution_id = queued_call(engine)
        with write(engine) as conn:
            conn.execute(
                update(executions)
                .where(executions.c.id == execution_id)
                .values(phase=phase.value, wake_at=now - timedelta(seconds=10))
            )
        wakes[phase] = execution_id
    stall = timedelta(seconds=5)
    with engine.connect() as conn:
        due = {r.id for r in scans.runs_due(conn, "wake", now, stall, 1000)}
        held = {
            r.id
            for r in scans.runs_due(
                conn, "wake", now, stall, 1000, held_back=timedelta(seconds=115)
            )
        }
    assert {wakes[Phase.AWAIT_TOOLS], wakes[Phase.CALL_MODEL]} <= due
    assert wakes[Phase.CALL_MODEL] in held
    assert wakes[Phase.AWAIT_TOOLS] not in held
