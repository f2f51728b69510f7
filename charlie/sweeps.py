"""Beat sweeps: find work whose message was lost, whose worker died, whose deadline passed.

Each sweep is bounded (at most ``LIMIT`` rows a run) and idempotent. Sweeps never execute a phase
or a tool: they re-publish messages, or settle a call whose outcome is already decided
(``interrupted``, ``deadline_exceeded``). Every action on a row is a compare-and-set, on
``swept_at`` or on the call's state, so two beats started by mistake, or two overlapping runs of
one sweep, act at most once per row per stall period.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, case, exists, or_, select, update

from charlie import scheduler
from charlie.app import app
from charlie.domain import JSON, CallState, Outcome, Phase, TaskStatus, utcnow
from charlie.runtime import Runtime, get_runtime
from charlie.store import calls as call_store
from charlie.store import runs
from charlie.store.engine import read, write, write_one
from charlie.store.heartbeats import record_heartbeat
from charlie.store.schema import executions, tasks, tool_calls

log = logging.getLogger("charlie.sweep")

LIMIT = 500
#: overdue waits looked at per sweep: each look is a message and a worker's poll.
WATCH_LIMIT = 50


def _throttle(column: Any, now: datetime, stall: timedelta) -> Any:
    return or_(column.is_(None), column < now - stall)


#: A lease is only treated as lapsed this long after its expiry: a live worker's renewal that is
#: a little late (a busy machine, a slow commit) must not look like a death.
LEASE_GRACE = timedelta(seconds=1)

ENDING = (Phase.REPORT_TERMINAL.value, Phase.REPORT_FAILURE.value, Phase.DONE.value)


def sweep_stalled_runs(rt: Runtime) -> int:
    """I4: re-publish the tick of runs that are due but not moving.

    - a lease that lapsed: the worker died mid-tick;
    - a stored wake-up time that has come (a model backoff, a report retry, a tool deadline);
    - ready but not moved for the stall period: a commit whose publish was lost, or a tick that
      dies inside its own transaction (its claim rolled back with it, so the attempt is counted
      here, which bounds a poison message in every phase);
    - a run whose task was canceled or timed out, so it stops at its boundary even if the poke
      that should have woken it was lost.
    """
    now = utcnow()
    stall = timedelta(seconds=rt.settings.stall_seconds)
    e, c, t = executions.c, tool_calls.c, tasks.c
    # An await whose turn has settled, quietly, for the stall period: its poke was lost.
    turn_quiet = ~exists().where(
        c.execution_id == e.id,
        c.turn == e.turn,
        or_(c.state != CallState.SETTLED.value, c.settled_at > now - stall),
    )
    stopped = exists().where(
        t.id == e.task_id,
        or_(
            t.status.in_((TaskStatus.CANCELED.value, TaskStatus.TIMED_OUT.value)),
            and_(t.status.in_(runs.ACTIVE), t.timeout_at < now),
        ),
    )
    free = e.lease_owner.is_(None)
    clauses = {
        "lapsed": and_(e.lease_until.is_not(None), e.lease_until < now - LEASE_GRACE),
        "wake": and_(free, e.wake_at.is_not(None), e.wake_at <= now),
        "stalled": and_(
            free,
            e.updated_at < now - stall,
            or_(
                and_(e.phase != Phase.AWAIT_TOOLS.value, e.wake_at.is_(None)),
                and_(e.phase == Phase.AWAIT_TOOLS.value, turn_quiet),
            ),
        ),
        "stopping": and_(free, e.phase.not_in(ENDING), stopped),
    }
    if _backlogged(rt):
        # A deep queue means ticks are waiting, not lost: re-publishing them would only deepen
        # it (each re-publish is one more message to drain). Lost ticks are found once it
        # drains; lapsed leases, wake-ups and stops still go.
        del clauses["stalled"]
    published = 0
    for reason, clause in clauses.items():
        with read(rt.engine) as conn:
            rows = conn.execute(
                select(e.id, e.phase, e.version)
                .where(e.phase != Phase.DONE.value, _throttle(e.swept_at, now, stall), clause)
                .limit(LIMIT)
            ).all()
        for row in rows:
            if _republish(
                rt,
                row.id,
                Phase(row.phase),
                row.version,
                now,
                stall,
                count_attempt=reason == "stalled",
                reason=reason,
            ):
                published += 1
    return published


def queue_depth(queue: str = "charlie") -> int | None:
    """Messages waiting in the broker queue, or None if the broker cannot say."""
    try:
        # The app's pool: a new connection per sweep would cost a connect and a ping each time.
        with app.pool.acquire(block=True) as conn:
            ok = conn.default_channel.queue_declare(queue=queue, passive=True)
            return int(ok.message_count)
    except Exception:
        log.debug("queue depth unavailable", exc_info=True)
        return None


def _backlogged(rt: Runtime) -> bool:
    depth = queue_depth()
    backlogged = depth is not None and depth > rt.settings.sweep_backlog_limit
    if backlogged:
        log.info("broker backlog of %s messages: not re-publishing stalled work", depth)
    return backlogged


def _republish(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    now: datetime,
    stall: timedelta,
    *,
    count_attempt: bool = False,
    reason: str = "",
) -> bool:
    """Publish a run's current tick if this sweeper wins the row for this stall period."""
    e = executions.c
    values: dict[str, Any] = {"swept_at": now}
    if count_attempt:
        # Only a re-publish that follows an earlier one which did not move the run counts: the
        # first may just be a lost message; a second means the tick dies where it runs.
        values["attempts"] = e.attempts + case((e.swept_at.is_not(None), 1), else_=0)
    with write(rt.engine) as conn:
        won = conn.execute(
            update(executions)
            .where(e.id == execution_id, e.version == version, _throttle(e.swept_at, now, stall))
            .values(**values)
        ).rowcount
    if not won:
        return False
    log.info(
        "re-published tick",
        extra={
            "execution_id": execution_id,
            "phase": phase.value,
            "version": version,
            "reason": reason,
        },
    )
    return rt.publisher.tick(execution_id, phase, version)


def _deadline_result(
    started_at: datetime | None, queued_at: datetime | None, deadline: datetime
) -> dict[str, Any]:
    return {
        "deadline_seconds": (deadline - queued_at).total_seconds() if queued_at else None,
        "deadline_at": deadline.isoformat(),
        "started_at": started_at.isoformat() if started_at else None,
        "note": "the work was not canceled and may still finish",
    }


def sweep_tool_calls(rt: Runtime) -> dict[str, int]:
    """I10, I11, I13: lost invoke messages, calls whose worker died, calls past deadline, and
    the late watch on waits that deadline settled."""
    now = utcnow()
    stall = timedelta(seconds=rt.settings.stall_seconds)
    c = tool_calls.c
    counts = {
        "republished": 0,
        "resumed": 0,
        "reconciling": 0,
        "interrupted": 0,
        "deadline": 0,
        "abandoned": 0,
        "watching": 0,
    }
    e = executions.c
    run_live = exists().where(e.id == c.execution_id, e.phase.not_in(ENDING))
    lapsed = c.lease_until < now - LEASE_GRACE
    backlogged = _backlogged(rt)
    with read(rt.engine) as conn:
        # Calls of a run that has ended (a failure, a race with a stop) are never dispatched
        # again; they settle canceled so each still has its one outcome.
        abandoned = conn.execute(
            select(c.execution_id, c.turn, c.call_id)
            .where(
                c.state != CallState.SETTLED.value,
                ~run_live,
                or_(c.lease_owner.is_(None), lapsed),
            )
            .limit(LIMIT)
        ).all()
        overdue = conn.execute(
            select(c.execution_id, c.turn, c.call_id, c.started_at, c.queued_at, c.deadline_at)
            .where(c.state != CallState.SETTLED.value, c.deadline_at < now)
            .limit(LIMIT)
        ).all()
        lost = conn.execute(
            select(c.execution_id, c.turn, c.call_id)
            .where(
                c.state == CallState.PENDING.value,
                c.queued_at < now - stall,
                _throttle(c.swept_at, now, stall),
                run_live,
            )
            .limit(LIMIT)
        ).all()
        orphaned = conn.execute(
            select(
                c.execution_id,
                c.turn,
                c.call_id,
                c.name,
                c.resumable,
                c.attempts,
                c.started_at,
                c.started_by,
                c.lease_owner,
                c.lease_until,
                c.handle,
            )
            .where(
                c.state == CallState.STARTED.value,
                lapsed,
                _throttle(c.swept_at, now, stall),
                run_live,
            )
            .limit(LIMIT)
        ).all()
        watched = call_store.overdue_waits(
            conn, now - timedelta(seconds=rt.settings.late_watch_seconds), now - stall, WATCH_LIMIT
        )

    for gone in abandoned:
        with write(rt.engine) as conn:
            if call_store.settle_call(
                conn,
                gone.execution_id,
                gone.turn,
                gone.call_id,
                Outcome.CANCELED.value,
                {"reason": "the run ended before this call finished"},
                f"sweep@{rt.worker}",
                now,
            ):
                counts["abandoned"] += 1

    for late in overdue:
        assert late.deadline_at is not None
        result = _deadline_result(late.started_at, late.queued_at, late.deadline_at)

        def past_deadline(conn: Connection, late: Any = late, result: JSON = result) -> bool:
            return call_store.settle_call(
                conn,
                late.execution_id,
                late.turn,
                late.call_id,
                Outcome.DEADLINE_EXCEEDED.value,
                result,
                f"sweep@{rt.worker}",
                now,
            )

        if _settle_as_a_worker_does(rt, late.execution_id, late.turn, past_deadline):
            counts["deadline"] += 1

    def take(row: Any) -> bool:
        with write(rt.engine) as conn:
            return bool(
                conn.execute(
                    update(tool_calls)
                    .where(
                        c.execution_id == row.execution_id,
                        c.turn == row.turn,
                        c.call_id == row.call_id,
                        _throttle(c.swept_at, now, stall),
                    )
                    .values(swept_at=now)
                ).rowcount
            )

    for lost_row in [] if backlogged else lost:
        if take(lost_row) and rt.publisher.invoke(
            lost_row.execution_id, lost_row.turn, lost_row.call_id, "start"
        ):
            counts["republished"] += 1

    # I13: a wait settled past its deadline is observed again, until its work is seen to end
    # (a late report) or the watch's window closes; whatever its run has done since.
    for watched_row in [] if backlogged else watched:
        if not call_store.due_for_a_look(watched_row.settled_at, watched_row.swept_at, now, stall):
            continue
        if take(watched_row) and rt.publisher.invoke(
            watched_row.execution_id, watched_row.turn, watched_row.call_id, "observe"
        ):
            counts["watching"] += 1

    for row in orphaned:
        definition = rt.tools.get(row.name)
        exhausted = row.attempts >= rt.settings.max_attempts
        if row.resumable and not exhausted:
            if take(row) and rt.publisher.invoke(row.execution_id, row.turn, row.call_id, "resume"):
                counts["resumed"] += 1
            continue
        if definition is not None and definition.reconcile is not None and not exhausted:
            if take(row) and rt.publisher.invoke(
                row.execution_id, row.turn, row.call_id, "reconcile"
            ):
                counts["reconciling"] += 1
            continue
        evidence = {
            "started_at": row.started_at.isoformat() if row.started_at else None,
            "started_by": row.started_by,
            "lease_owner": row.lease_owner,
            "lease_until": row.lease_until.isoformat() if row.lease_until else None,
            "attempts": row.attempts,
            "handle": row.handle,
            "reason": (
                f"its worker died {row.attempts} times" if exhausted else "its worker stopped"
            ),
        }
        # Only a call still started with a lapsed lease: never one a live worker holds.
        interrupt = (
            update(tool_calls)
            .where(
                c.execution_id == row.execution_id,
                c.turn == row.turn,
                c.call_id == row.call_id,
                c.state == CallState.STARTED.value,
                lapsed,
            )
            .values(
                state=CallState.SETTLED.value,
                outcome=Outcome.INTERRUPTED.value,
                result=evidence,
                settled_at=now,
                settled_by=f"sweep@{rt.worker}",
                lease_owner=None,
            )
        )

        def interrupted(conn: Connection, interrupt: Any = interrupt) -> bool:
            return bool(conn.execute(interrupt).rowcount == 1)

        if _settle_as_a_worker_does(rt, row.execution_id, row.turn, interrupted):
            counts["interrupted"] += 1
            log.warning(
                "call interrupted",
                extra={"execution_id": row.execution_id, "call_id": row.call_id, **evidence},
            )
    return counts


def _settle_as_a_worker_does(
    rt: Runtime, execution_id: str, turn: int, settle: Callable[[Connection], bool]
) -> bool:
    """Settle one call as a worker does (I7): the run's row locked first, then the call, and in
    the same transaction whether it was the turn's last open call. Of two settling a turn's
    last two calls, the second sees the first's commit, so one of them always knows the turn
    is complete and moves the run on; then this publishes the run's await tick."""
    with write(rt.engine) as conn:
        settled, await_version = call_store.settle_in_turn(conn, execution_id, turn, settle)
    if await_version is not None:
        rt.publisher.tick(execution_id, Phase.AWAIT_TOOLS, await_version)
    return settled


def sweep_task_timeouts(rt: Runtime) -> int:
    """I18: time out tasks past their timeout, with their children; each run stops at its next
    boundary, which this publishes now rather than waiting for its tools."""
    now = utcnow()
    t = tasks.c
    with read(rt.engine) as conn:
        due = [
            r.id
            for r in conn.execute(
                select(t.id)
                .where(t.status.in_(("queued", "running", "waiting")), t.timeout_at < now)
                .limit(LIMIT)
            )
        ]
    if not due:
        return 0
    expired = scheduler.expire(rt.engine, due)
    stopped = list(expired)
    for task_id in expired:
        stopped += scheduler.cancel_descendants(rt.engine, task_id)
    poke_tasks(rt, stopped)
    return len(expired)


def poke_tasks(rt: Runtime, task_ids: list[str]) -> None:
    """Publish the current tick of these tasks' runs so they reach a boundary now."""
    if not task_ids:
        return
    e = executions.c
    with read(rt.engine) as conn:
        rows = conn.execute(
            select(e.id, e.phase, e.version).where(
                e.task_id.in_(task_ids), e.phase != Phase.DONE.value
            )
        ).all()
    for row in rows:
        rt.publisher.tick(row.id, Phase(row.phase), row.version)


#: a sweep records that it ran at most this often per process (doctor's staleness is far longer).
HEARTBEAT_EVERY = 5.0


def heartbeat(rt: Runtime, name: str) -> None:
    """Record in the database that sweep ``name`` ran, so `charlie doctor` can tell that a beat
    drives recovery. Best effort: a refused write must not stop the sweep itself."""
    now = time.monotonic()
    if now - rt.heartbeats_sent.get(name, -HEARTBEAT_EVERY) < HEARTBEAT_EVERY:
        return
    try:
        with write_one(rt.engine) as conn:
            record_heartbeat(conn, name, rt.worker, utcnow())
    except Exception:
        log.warning("could not record the %s heartbeat", name, exc_info=True)
        return
    rt.heartbeats_sent[name] = now


@app.task(name="charlie.sweep.stalled_runs", ignore_result=True)
def stalled_runs() -> int:
    rt = get_runtime()
    heartbeat(rt, "sweep.stalled_runs")
    return sweep_stalled_runs(rt)


@app.task(name="charlie.sweep.tool_calls", ignore_result=True)
def tool_call_sweep() -> dict[str, int]:
    rt = get_runtime()
    heartbeat(rt, "sweep.tool_calls")
    return sweep_tool_calls(rt)


@app.task(name="charlie.sweep.task_timeouts", ignore_result=True)
def task_timeouts() -> int:
    rt = get_runtime()
    heartbeat(rt, "sweep.task_timeouts")
    return sweep_task_timeouts(rt)
