"""Beat sweeps: find work whose message was lost, whose worker died, whose deadline passed.

Each sweep is bounded (at most ``LIMIT`` rows a run) and idempotent. Sweeps never execute a phase
or a tool: they re-publish messages, or settle a call whose outcome is already decided
(``interrupted``, ``deadline_exceeded``) the way a worker settles one
(:mod:`charlie.executor.settle`). Every action on a row is a compare-and-set, on ``swept_at`` or
on the call's state (see :mod:`charlie.store.scans`), so two beats started by mistake, or two
overlapping runs of one sweep, act at most once per row per stall period. The Celery tasks that
run them are declared in :mod:`charlie.worker`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from charlie import scheduler
from charlie.app import app
from charlie.config import SWEEP_QUEUE, TICK_QUEUE
from charlie.domain import Outcome, Phase, utcnow
from charlie.executor.settle import report_call, settle_and_move
from charlie.observe import SweepEvent, safely
from charlie.runtime import Runtime
from charlie.store import calls as call_store
from charlie.store import heartbeats, scans
from charlie.store import limits as limits_store
from charlie.store.engine import read, write, write_one
from charlie.store.heartbeats import SWEEP_NAMES, record_heartbeat
from charlie.store.types import Connection

log = logging.getLogger("charlie.sweep")

LIMIT = 500
#: overdue waits looked at per sweep: each look is a message and a worker's poll.
WATCH_LIMIT = 50


def sweep_stalled_runs(rt: Runtime) -> int:
    """I4: re-publish the tick of runs that are due but not moving.

    - a lease that lapsed: the worker died mid-tick;
    - a stored wake-up time that has come (a model backoff, a report retry, a tool deadline);
    - ready but not moved for the stall period: a commit whose publish was lost, or a tick that
      dies inside its own transaction (its claim rolled back with it, so the attempt is counted
      here, which bounds a poison message in every phase);
    - a run whose task was canceled or timed out, so it stops at its boundary even if the poke
      that should have woken it was lost;
    - every CHARLIE_SWEEP_PROBE_SECONDS, a run in await_tools whose turn has settled and that
      has no wake-up to be found by (see scans.PROBE).

    A run in await_tools is otherwise not read: the settle that completes its turn stores a
    wake-up a stall period ahead, which the "wake" scan finds if the tick after it is lost.
    """
    now = utcnow()
    normal = timedelta(seconds=rt.settings.stall_seconds)
    # A deep queue means ticks are waiting, not lost: re-publishing every run that merely looks
    # stalled would only deepen it (each re-publish is one more message to drain). In a backlog
    # a run counts as stalled only after CHARLIE_SWEEP_BACKLOG_MAX_WAIT, and is re-published at
    # most once per that period, so a tick really lost meanwhile waits that long, not for the
    # backlog to drain; lapsed leases, wake-ups and stops still go at once.
    backlog = _backlog_stall(rt) if _backlogged(rt) else None
    published = 0
    reasons = [*scans.RUN_REASONS, *([scans.PROBE] if _probe_due(rt) else [])]
    for reason in reasons:
        stall = backlog if backlog is not None and reason in ("stalled", scans.PROBE) else normal
        held_back = backlog - normal if backlog is not None and reason == "wake" else None
        with read(rt.engine) as conn:
            rows = scans.runs_due(conn, reason, now, stall, LIMIT, held_back=held_back)
        for row in rows:
            if _republish(
                rt,
                row.id,
                Phase(row.phase),
                row.version,
                now,
                stall,
                reason=reason,
                priority=row.priority,
            ):
                published += 1
    return published


def _probe_due(rt: Runtime) -> bool:
    """Whether this round also probes the runs in await_tools (CHARLIE_SWEEP_PROBE_SECONDS;
    the first round of a process does; and every round during a rolling upgrade: while a
    worker of a release whose settles store no wake-up is about, or was lately, its lost await
    ticks are found within a stall period and a round, as I4 says, not a probe period)."""
    now = time.monotonic()
    recent = rt.probed_at is not None and now - rt.probed_at < rt.settings.sweep_probe_seconds
    if recent and not _earlier_release_about(rt):
        return False
    rt.probed_at = now
    return True


def _earlier_release_about(rt: Runtime) -> bool:
    """A worker of a release before settle wake-ups has beaten within the time its last
    settle's lost tick takes to be found: a heartbeat period, a stall period and a round."""
    from charlie.presence import EVERY, WAITING

    window = timedelta(seconds=6 * EVERY + rt.settings.stall_seconds)
    try:
        with read(rt.engine) as conn:
            return heartbeats.earlier_release_about(conn, utcnow() - window, WAITING)
    except Exception:  # the heartbeats unreadable: the probe's own period then
        log.warning("could not read the workers' heartbeats", exc_info=True)
        return False


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


def _backlog_stall(rt: Runtime) -> timedelta:
    """How long work must look stalled, in a backlog, before it is re-published anyway."""
    return timedelta(seconds=max(rt.settings.sweep_backlog_max_wait, rt.settings.stall_seconds))


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
    reason: str = "",
    priority: int | None = None,
) -> bool:
    """Publish a run's current tick if this sweeper wins the row for this stall period.

    The tick goes out durable: the worker that takes it commits its claim, and the attempt,
    before the phase runs. A tick that dies where it runs is thus counted on every try (poison
    messages end in report_failure), and one that only waited behind busy workers is not."""
    with write(rt.engine) as conn:
        won = scans.win_run(conn, execution_id, version, now, stall)
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
    return rt.publisher.tick(execution_id, phase, version, durable=True, priority=priority)


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
    sweep = _CallSweep(rt, utcnow(), timedelta(seconds=rt.settings.stall_seconds))
    backlogged = _backlogged(rt)
    # A lost invoke waits, in a backlog, at most CHARLIE_SWEEP_BACKLOG_MAX_WAIT (as a run does).
    lost_stall = _backlog_stall(rt) if backlogged else sweep.stall
    now, stall = sweep.now, sweep.stall
    with read(rt.engine) as conn:
        abandoned = scans.abandoned_calls(conn, now, LIMIT)
        overdue = scans.overdue_calls(conn, now, LIMIT)
        lost = scans.lost_calls(conn, now, lost_stall, LIMIT)
        orphaned = scans.orphaned_calls(conn, now, stall, LIMIT)
        watched = call_store.overdue_waits(
            conn, now - timedelta(seconds=rt.settings.late_watch_seconds), now - stall, WATCH_LIMIT
        )
    for gone in abandoned:
        sweep.cancel_abandoned(gone)
    for late in overdue:
        sweep.settle_overdue(late)
    for lost_row in lost:
        sweep.republish_lost(lost_row, lost_stall)
    # I13: a wait settled past its deadline is observed again, until its work is seen to end
    # (a late report) or the watch's window closes; whatever its run has done since.
    for watched_row in [] if backlogged else watched:
        sweep.watch_late(watched_row)
    for row in orphaned:
        sweep.recover_orphan(row)
    return sweep.counts


class _CallSweep:
    """One round of sweep_tool_calls: its clock, its stall period and what it did, one method
    per kind of row its scans found (each row's action is its own compare-and-set)."""

    def __init__(self, rt: Runtime, now: datetime, stall: timedelta) -> None:
        self.rt = rt
        self.now = now
        self.stall = stall
        self.counts = dict.fromkeys(
            (
                "republished",
                "resumed",
                "reconciling",
                "interrupted",
                "held",
                "deadline",
                "abandoned",
                "watching",
            ),
            0,
        )

    @property
    def settler(self) -> str:
        return f"sweep@{self.rt.worker}"

    def cancel_abandoned(self, gone: Any) -> None:
        """A call of a run that ended settles canceled (I11)."""
        with write(self.rt.engine) as conn:
            canceled = call_store.settle_call(
                conn,
                gone.execution_id,
                gone.turn,
                gone.call_id,
                Outcome.CANCELED.value,
                {"reason": "the run ended"},
                self.settler,
                self.now,
            )
        if canceled:  # reported once committed
            self.counts["abandoned"] += 1
            _report_call(self.rt, gone, Outcome.CANCELED)

    def settle_overdue(self, late: Any) -> None:
        """A call past its deadline settles deadline_exceeded and its turn moves on (I10)."""
        assert late.deadline_at is not None
        result = _deadline_result(late.started_at, late.queued_at, late.deadline_at)

        def past_deadline(conn: Connection) -> bool:
            return call_store.settle_call(
                conn,
                late.execution_id,
                late.turn,
                late.call_id,
                Outcome.DEADLINE_EXCEEDED.value,
                result,
                self.settler,
                self.now,
            )

        if settle_and_move(
            self.rt, late.execution_id, late.turn, past_deadline, priority=late.priority
        ):
            self.counts["deadline"] += 1
            _report_call(self.rt, late, Outcome.DEADLINE_EXCEEDED)

    def take(self, row: Any, period: timedelta | None = None) -> bool:
        """Win ``row`` for this stall period (two beats act at most once per row)."""
        with write(self.rt.engine) as conn:
            return scans.win_call(
                conn,
                row.execution_id,
                row.turn,
                row.call_id,
                self.now,
                self.stall if period is None else period,
            )

    def invoke(self, row: Any, mode: str, count: str, period: timedelta | None = None) -> None:
        """Publish ``mode`` for a call this sweep won, counted once published."""
        # The scans of calls read their run's priority; the late watch's rows have none (the
        # run may have ended since): the broker's default level.
        if self.take(row, period) and self.rt.publisher.invoke(
            row.execution_id, row.turn, row.call_id, mode, priority=getattr(row, "priority", 0)
        ):
            self.counts[count] += 1

    def republish_lost(self, row: Any, lost_stall: timedelta) -> None:
        """A call queued but never started: its invoke message was lost."""
        self.invoke(row, "start", "republished", lost_stall)

    def watch_late(self, row: Any) -> None:
        if call_store.due_for_a_look(row.settled_at, row.swept_at, self.now, self.stall):
            self.invoke(row, "observe", "watching")

    def recover_orphan(self, row: Any) -> None:
        """A started call whose worker stopped: resumed, reconciled, held for an operator, or
        settled interrupted (I11), by what the call declared and how often it was tried."""
        definition = self.rt.tools.get(row.name)
        exhausted = row.attempts >= self.rt.settings.max_attempts
        if row.resumable and not exhausted:
            self.invoke(row, "resume", "resumed")
            return
        # Whether the call's own implementation can read back what happened, only a worker that
        # has it can tell: for a call started with one this process lacks, ask for a reconcile
        # (a worker with it runs its hook or settles the call interrupted; the others refuse,
        # see executor.invoke._refuse), and never decide by another tool of the same name.
        foreign = row.implementation is not None and (
            definition is None or definition.implementation != row.implementation
        )
        reconciles = foreign or (definition is not None and definition.reconcile is not None)
        if reconciles and not exhausted:
            self.invoke(row, "reconcile", "reconciling")
            return
        evidence = _orphan_evidence(row, exhausted)
        if row.on_interrupt == "hold":
            self.hold(row, evidence)
        else:
            self.interrupt(row, evidence)

    def hold(self, row: Any, evidence: dict[str, Any]) -> None:
        """Not reported to the model: an operator decides (charlie.reconcile). Held, it leaves
        the turn open, so there is no turn to move."""
        with write(self.rt.engine) as conn:
            call_store.lock_run(conn, row.execution_id)
            held = call_store.hold_interrupted(
                conn, row.execution_id, row.turn, row.call_id, evidence, self.now
            )
        if held:
            self.counts["held"] += 1
            log.warning(
                "call held for an operator's verdict",
                extra={"execution_id": row.execution_id, "call_id": row.call_id, **evidence},
            )

    def interrupt(self, row: Any, evidence: dict[str, Any]) -> None:
        def interrupted(conn: Connection) -> bool:
            return scans.interrupt_call(
                conn,
                row.execution_id,
                row.turn,
                row.call_id,
                evidence,
                self.now,
                self.settler,
            )

        if settle_and_move(self.rt, row.execution_id, row.turn, interrupted, priority=row.priority):
            self.counts["interrupted"] += 1
            _report_call(self.rt, row, Outcome.INTERRUPTED)
            log.warning(
                "call interrupted",
                extra={"execution_id": row.execution_id, "call_id": row.call_id, **evidence},
            )


def _orphan_evidence(row: Any, exhausted: bool) -> dict[str, Any]:
    """What an operator (or the model) is shown of a call whose worker stopped."""
    return {
        "started_at": row.started_at.isoformat() if row.started_at else None,
        "started_by": row.started_by,
        "lease_owner": row.lease_owner,
        "lease_until": row.lease_until.isoformat() if row.lease_until else None,
        "attempts": row.attempts,
        "handle": row.handle,
        "implementation": row.implementation,
        "reason": (f"its worker died {row.attempts} times" if exhausted else "its worker stopped"),
    }


def _report_call(rt: Runtime, row: Any, outcome: Outcome) -> None:
    """Tell telemetry of a call this sweep settled (the row as its scan read it)."""
    report_call(
        rt,
        row.execution_id,
        row.turn,
        row.call_id,
        getattr(row, "name", None) or "?",
        outcome.value,
        by=f"sweep@{rt.worker}",
        started=getattr(row, "started_at", None),
    )


def sweep_task_timeouts(rt: Runtime) -> int:
    """I18: time out tasks past their timeout, with their children; each run stops at its next
    boundary, which this publishes now rather than waiting for its tools."""
    with read(rt.engine) as conn:
        due = scans.tasks_past_timeout(conn, utcnow(), LIMIT)
    if not due:
        return 0
    expired = scheduler.expire(rt.engine, due)
    stopped = list(expired)
    for task_id in expired:
        stopped += scheduler.cancel_descendants(rt.engine, task_id)
    rt.poke(stopped)
    return len(expired)


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


#: the sweeps by the names their heartbeats (and `charlie doctor`) know them by.
SWEEPS: dict[str, Callable[[Runtime], object]] = dict(
    zip(SWEEP_NAMES, (sweep_stalled_runs, sweep_tool_calls, sweep_task_timeouts), strict=True)
)


def run_sweep(rt: Runtime, name: str) -> object:
    """Run one sweep and record its heartbeat (for `charlie doctor`: a beat drives recovery)."""
    started = time.time()
    result = SWEEPS[name](rt)
    heartbeat(rt, name)
    if rt.observer.enabled:
        ended = time.time()
        actions: dict[str, Any] = result if isinstance(result, dict) else {"acted": result}
        for action, count in actions.items():
            if isinstance(count, int) and count:
                safely(
                    rt.observer.sweep,
                    SweepEvent(name, action, int(count), started, ended, rt.worker),
                )
        if name == GAUGE_SWEEP:
            # The fleet's gauges, with one sweep so that `charlie beat` and
            # --celery-beat (the sweeps as tasks on the workers) both read them; an observer
            # that serves no metrics never does, a metrics observer at most every
            # CHARLIE_METRICS_GAUGE_SECONDS.
            safely(rt.observer.gauges, lambda: fleet_gauges(rt))
    return result


def sweep_round(rt: Runtime) -> dict[str, object]:
    """Every sweep once. One failing (the database away, a broker hiccup) does not stop the
    others, nor the next round."""
    results: dict[str, object] = {}
    for name in SWEEPS:
        try:
            results[name] = run_sweep(rt, name)
        except Exception:
            log.exception("%s failed; trying again next round", name)
    return results


#: the sweep after which the fleet's gauges are read
GAUGE_SWEEP = "sweep.stalled_runs"
#: the broker queues whose depth the gauges report.
GAUGE_QUEUES = (TICK_QUEUE, SWEEP_QUEUE)


def fleet_gauges(rt: Runtime) -> dict[str, Any]:
    """What the fleet looks like now, for metrics: the database's counts and the broker's
    queue depths (each None where the broker cannot say)."""
    with read(rt.engine) as conn:
        found = scans.fleet_gauges(conn, utcnow(), timedelta(seconds=rt.settings.stall_seconds))
        if rt.settings.model_limits:
            found["model_limits"] = {
                s.key: (s.in_flight, s.waiting) for s in limits_store.statuses(conn, utcnow())
            }
    found["queue_depth"] = {queue: queue_depth(queue) for queue in GAUGE_QUEUES}
    return found


def run_beat(rt: Runtime, stop: threading.Event, liveness: Path | None = None) -> None:
    """`charlie beat`: run the sweeps in this process every CHARLIE_SWEEP_INTERVAL.

    Recovery runs here, not as tasks on the workers' pools: pools busy with hour-long tools
    would leave a queued sweep waiting for a free slot while lost ticks stay lost (I4). What
    the sweeps decide is still carried out by the workers (a re-published tick queues for the
    next free slot); finding it does not wait. ``liveness`` is touched after every round, for
    supervisors that check a file's age."""
    interval = rt.settings.sweep_interval
    log.info("sweeping every %ss (stall %ss, lease %ss)", interval, rt.settings.stall_seconds,
             rt.settings.lease_seconds)  # fmt: skip
    while not stop.is_set():
        started = time.monotonic()
        results = sweep_round(rt)
        acted = {name: r for name, r in results.items() if _acted(r)}
        if acted:
            log.info("sweep round: %s", acted)
        if liveness is not None:
            with contextlib.suppress(OSError):
                liveness.touch()
        stop.wait(max(0.0, interval - (time.monotonic() - started)))


def _acted(result: object) -> bool:
    if isinstance(result, dict):
        return any(result.values())
    return bool(result)
