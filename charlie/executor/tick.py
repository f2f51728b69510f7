"""One tick: claim → boundary → phase → commit → publish (I1, I2, I5, I17, I18).

Phases without slow I/O run inside the claim's transaction. ``call_model`` and the report
phases claim in one short transaction, work outside any transaction while a heartbeat renews the
lease, and commit in a second one that succeeds only if the lease is still theirs.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from sqlalchemy import Connection, update
from sqlalchemy.exc import SQLAlchemyError

from charlie import faults
from charlie.domain import Phase, RunView, TaskStatus, Transition
from charlie.executor import boundary
from charlie.executor.phases import needs, run_phase
from charlie.leases import heartbeat
from charlie.runtime import Runtime
from charlie.store import runs
from charlie.store.engine import read, write
from charlie.store.schema import tasks

log = logging.getLogger("charlie.tick")

SLOW_PHASES = frozenset({Phase.CALL_MODEL, Phase.REPORT_TERMINAL, Phase.REPORT_FAILURE})

TickResult = Literal["stale", "moved", "waiting", "lost_lease", "done", "refused"]


def utcnow() -> datetime:
    return datetime.now(UTC)


def _view(conn: Connection, claim: runs.Claim, now: datetime) -> RunView | None:
    task = runs.load_task(conn, claim.task_id)
    if task is None:
        return None
    wanted = needs(claim.phase) | ({"calls"} if claim.phase in boundary.TOOL_PHASES else set())
    return RunView(
        execution_id=claim.execution_id,
        phase=claim.phase,
        version=claim.version,
        turn=claim.turn,
        state=claim.state,
        attempts=claim.attempts,
        task=task,
        now=now,
        items=runs.load_items(conn, claim.execution_id) if "items" in wanted else [],
        # Locked in tool phases: a settle racing this tick waits, then finds the call settled
        # and becomes a late report, so the transcript and the record agree (I8, I12).
        calls=runs.load_calls(conn, claim.execution_id, claim.turn, lock=True)
        if "calls" in wanted
        else [],
        last_error=claim.last_error,
    )


def _decide_at_boundary(rt: Runtime, view: RunView) -> Transition | None:
    """What the tick does instead of the phase, if anything."""
    if view.attempts > rt.settings.max_attempts:
        return boundary.poison(view, rt.settings.max_attempts)
    reason = boundary.stop_reason(view)
    if reason is not None:
        return boundary.stop(view, reason)
    return None


def _heartbeat(rt: Runtime, claim: runs.Claim) -> AbstractContextManager[None]:
    """Renew the run's lease while slow work runs (I5)."""

    def renew(conn: Connection) -> bool:
        until = utcnow() + timedelta(seconds=rt.settings.lease_seconds)
        return runs.renew_execution_lease(conn, claim.execution_id, claim.version, rt.worker, until)

    return heartbeat(rt.engine, renew, rt.settings.lease_seconds / 3, f"lease-{claim.execution_id}")


def _compute(rt: Runtime, view: RunView) -> Transition:
    try:
        return run_phase(view, rt.deps)
    except Exception as exc:
        if view.phase is Phase.REPORT_FAILURE:
            # Reporting a failure failed: come back later rather than fail the failure.
            log.exception("report_failure raised", extra=_ctx(view))
            retries = int(view.state.get("report_failure_retries", 0)) + 1
            return Transition(
                to=None,
                state={**view.state, "report_failure_retries": retries},
                wake_at=view.now + timedelta(seconds=min(60, 2**retries)),
                publish_next=False,
                note=f"report_failure raised {type(exc).__name__}",
            )
        log.exception("phase raised; moving to report_failure", extra=_ctx(view))
        return boundary.fail(view, exc)


def _ctx(view: RunView) -> dict[str, object]:
    return {
        "execution_id": view.execution_id,
        "task_id": view.task.id,
        "phase": view.phase.value,
        "version": view.version,
    }


def _commit(
    rt: Runtime,
    conn: Connection,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    started: float,
) -> bool:
    error = None
    if transition.to is Phase.REPORT_FAILURE and transition.state:
        error = transition.state.get("error")
    ok = runs.commit_transition(
        conn,
        claim,
        transition,
        owner=rt.worker,
        now=utcnow(),
        duration_ms=(time.perf_counter() - started) * 1000,
        error=error,
    )
    if ok and transition.to is Phase.DONE and transition.state and "poison" in transition.state:
        conn.execute(
            update(tasks)
            .where(tasks.c.id == view.task.id, tasks.c.status.in_(runs.ACTIVE))
            .values(
                status=TaskStatus.FAILED.value,
                error=transition.state["poison"],
                finished_at=utcnow(),
            )
        )
    return ok


def _publish(
    rt: Runtime,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    *,
    publish_next: bool = True,
) -> None:
    faults.hit("tick.after_commit", phase=claim.phase.value, task_id=view.task.id)
    messages: list[tuple[str, tuple[object, ...]]] = []
    for call_id, _deadline in transition.queue_calls:
        messages.append(("charlie.tool.invoke", (claim.execution_id, claim.turn, call_id, "start")))
    if (
        publish_next
        and transition.to is not None
        and transition.publish_next
        and transition.to is not Phase.DONE
    ):
        messages.append(
            (f"charlie.phase.{transition.to.value}", (claim.execution_id, claim.version + 1))
        )
    if messages:
        try:
            rt.publisher.many(messages)
        except Exception:
            log.exception("publish failed after commit; the sweep will re-publish")


def run_tick(
    rt: Runtime, execution_id: str, phase: Phase, version: int, *, durable_claim: bool = False
) -> TickResult:
    """Run one tick; with ``CHARLIE_INLINE_PHASES``, go on to the next phases in this worker.

    Inline, each phase is still claimed, committed and recorded as its own transition; only the
    publish of its tick (and the trip through the broker) is skipped. A crash between them is a
    commit whose tick was never published, which the sweep finds (I4)."""
    budget = rt.settings.inline_phases
    while True:
        result, follow = _guarded_tick(
            rt, execution_id, phase, version, inline=budget > 0, durable_claim=durable_claim
        )
        if follow is None:
            return result
        phase, version = follow
        budget -= 1
        durable_claim = False


def _guarded_tick(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    *,
    inline: bool,
    durable_claim: bool = False,
) -> tuple[TickResult, tuple[Phase, int] | None]:
    progress = _Progress(inline=inline, durable_claim=durable_claim)
    try:
        return _run_tick(rt, execution_id, phase, version, progress)
    except SQLAlchemyError as exc:
        # The database refused a write (or went away) mid-tick: nothing was committed. Keep the
        # error as evidence and release the lease so the sweep retries without waiting for it
        # to lapse; the attempt counter bounds the retries (then report_failure says why).
        log.exception(
            "tick could not commit",
            extra={"execution_id": execution_id, "phase": phase.value, "version": version},
        )
        error = {
            "phase": phase.value,
            "type": type(exc).__name__,
            "message": str(getattr(exc, "orig", None) or exc)[:2000],
            "at": utcnow().isoformat(),
        }
        try:
            with write(rt.engine) as conn:
                runs.record_refused_tick(
                    conn,
                    execution_id,
                    version,
                    rt.worker,
                    error,
                    claim_committed=progress.claim_committed,
                )
        except SQLAlchemyError:
            log.warning("could not record the refused write either; the lease will lapse")
        return "refused", None


@dataclass
class _Progress:
    #: the claim's transaction committed (the slow path), so the attempt was already counted.
    claim_committed: bool = False
    #: the next phase may run in this worker instead of being published.
    inline: bool = False
    #: commit the claim (and its attempt count) before running even a fast phase.
    durable_claim: bool = False


def _run_tick(
    rt: Runtime, execution_id: str, phase: Phase, version: int, progress: _Progress
) -> tuple[TickResult, tuple[Phase, int] | None]:
    started = time.perf_counter()
    slow = phase in SLOW_PHASES or progress.durable_claim
    with write(rt.engine) as conn:
        # After BEGIN: on SQLite the write lock may take a while, and a lease computed before
        # waiting for it could be born expired.
        now = utcnow()
        claim = runs.claim_execution(
            conn, execution_id, phase, version, rt.worker, now, rt.settings.lease_seconds
        )
        if claim is None:
            log.debug("stale tick %s %s v%s", execution_id, phase.value, version)
            return "stale", None
        view = _view(conn, claim, now)
        if view is None:
            log.error("execution %s has no task row", execution_id)
            return "stale", None
        decided = _decide_at_boundary(rt, view)
        if not slow or decided is not None:
            if decided is None:
                transition = _compute(rt, view)
                faults.hit("tick.in_transaction", phase=phase.value, task_id=view.task.id)
            else:
                transition = decided
            if not _commit(rt, conn, claim, view, transition, started):
                return "lost_lease", None
            slow = False
    progress.claim_committed = True
    if slow:
        faults.hit("tick.before_work", phase=phase.value, task_id=view.task.id)
        # The claim committed; from here until the commit no transaction is open (I5).
        with _heartbeat(rt, claim):
            transition = _compute(rt, view)
        if phase not in SLOW_PHASES:  # a fast phase run with a durable claim
            faults.hit("tick.in_transaction", phase=phase.value, task_id=view.task.id)
        faults.hit("tick.before_commit", phase=phase.value, task_id=view.task.id)
        with write(rt.engine) as conn:
            if not _commit(rt, conn, claim, view, transition, started):
                log.warning("lease lost during %s; discarding its result", phase.value)
                return "lost_lease", None
    follow = (
        (transition.to, claim.version + 1)
        if progress.inline
        and transition.to is not None
        and transition.to is not Phase.DONE
        and transition.publish_next
        else None
    )
    _publish(rt, claim, view, transition, publish_next=follow is None)
    if transition.to is None:
        _recheck_turn(rt, claim.execution_id, claim.turn, claim.phase, claim.version)
        return "waiting", None
    if transition.to is Phase.AWAIT_TOOLS and not transition.publish_next:
        _recheck_turn(rt, claim.execution_id, claim.turn, Phase.AWAIT_TOOLS, claim.version + 1)
    log.info(
        "transition %s -> %s",
        phase.value,
        transition.to.value,
        extra={**_ctx(view), "to": transition.to.value, "note": transition.note},
    )
    if transition.to is Phase.DONE:
        from charlie.tools.invoke import poke_waiters

        poke_waiters(rt, view.task.id)
        return "done", None
    return "moved", follow


def _recheck_turn(rt: Runtime, execution_id: str, turn: int, phase: Phase, version: int) -> None:
    """Publish the await tick if the turn has already settled. Settlers publish it themselves,
    but only when they see the run in await_tools: one that settled while this tick held the
    run (or before it entered await_tools) saw another phase, or had its tick refused as busy.
    Whichever of us looks last sees both commits."""
    if phase is not Phase.AWAIT_TOOLS:
        return
    with read(rt.engine) as conn:
        unsettled = runs.count_unsettled(conn, execution_id, turn)
    if unsettled == 0:
        rt.publisher.tick(execution_id, phase, version)
