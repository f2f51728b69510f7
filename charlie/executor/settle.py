"""Settling a call and moving its turn: the one way every settler does it (I7, I12, I13).

Workers (a published invocation, a turn's local call) and the sweeps (a deadline, a dead
worker's call) all settle through here: the run's row locked first, then the call, first result
wins, and in the same transaction whether that was the turn's last open call. Of two settlers of
a turn's last two calls the second sees the first's commit, so exactly one of them learns the
turn is complete; that one moves the run (its await tick), after the commit.

This module runs no tick itself: it returns the await tick's version and :func:`move_turn`
publishes it, or hands it to the ``run_here`` callable a worker passes (the tick shell), so the
dependency points from the tick down to here and never back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from charlie import faults
from charlie.domain import Outcome, Phase, RunView, Settlement, task_id_of, utcnow
from charlie.executor.streamed import settled_id
from charlie.observe import CallEvent, safely
from charlie.runtime import Runtime
from charlie.store import calls, fused
from charlie.store.calls import ClaimedCall, Mode
from charlie.store.engine import again_if_disconnected, write, write_one
from charlie.store.types import Connection

log = logging.getLogger("charlie.tool")

#: Runs a run's await tick in this worker: ``run_here(execution_id, version)``.
RunHere = Callable[[str, int], object]


@dataclass(frozen=True)
class CallResult:
    """What a call's handler produced, ready to settle."""

    call: ClaimedCall
    outcome: Outcome
    result: Any
    duration_ms: float
    mode: Mode


def settle_in_turn(
    rt: Runtime, execution_id: str, turn: int, settle: Callable[[Connection], bool]
) -> tuple[bool, int | None]:
    """Run ``settle`` (False: it settled nothing) in one transaction with the run locked first
    (see store.calls.settle_in_turn). Returns whether it settled, and the version of the run's
    await tick when this completed the turn of a run waiting in await_tools, else None."""
    with write(rt.engine) as conn:
        return calls.settle_in_turn(conn, execution_id, turn, settle, recheck_at(rt))


def recheck_at(rt: Runtime) -> datetime:
    """When the sweeps look again at a run whose turn a settle completes, in case the await
    tick published after it is lost: a stall period ahead (see
    store.calls.await_version_if_complete)."""
    return utcnow() + rt.stall


def move_turn(
    rt: Runtime,
    execution_id: str,
    version: int,
    run_here: RunHere | None = None,
    *,
    priority: int | None = None,
) -> None:
    """The turn has settled and its run waits in await_tools at ``version``: move it (I7).

    A worker with inline phases runs that tick at once (committed and recorded as its own
    transition like any other); otherwise, and always for the sweeps (which never run a
    phase), it is published. Either way a crash before it leaves a run in await_tools with
    every call settled, which the sweep re-publishes (I4).

    ``priority``: the run's, when the caller read it (a sweep's scan); None inside a worker's
    task, whose message was the run's and carries its priority (runtime.Publisher)."""
    if run_here is not None and rt.settings.inline_phases > 0:
        run_here(execution_id, version)
    else:
        rt.publisher.tick(execution_id, Phase.AWAIT_TOOLS, version, priority=priority)


def settle_and_move(
    rt: Runtime,
    execution_id: str,
    turn: int,
    settle: Callable[[Connection], bool],
    run_here: RunHere | None = None,
    *,
    priority: int | None = None,
) -> bool:
    """Settle one call and, if that completed the turn, move the run (its await tick published
    with ``priority``, see move_turn). Returns whether it settled (False: the call had an
    outcome already, I12)."""
    settled, await_version = settle_in_turn(rt, execution_id, turn, settle)
    if await_version is not None:
        move_turn(rt, execution_id, await_version, run_here, priority=priority)
    return settled


def held_for_operator(done: CallResult) -> bool:
    """An interrupted outcome of an ``on_interrupt="hold"`` tool (its reconcile hook could not
    tell, or it has none): an operator decides it, the model is not told (charlie.reconcile)."""
    return done.outcome is Outcome.INTERRUPTED and done.call.on_interrupt == "hold"


def _hold(rt: Runtime, done: CallResult) -> bool:
    call = done.call
    with write(rt.engine) as conn:
        calls.lock_run(conn, call.execution_id)  # settlers' order: the run, then the call
        if calls.hold_interrupted(
            conn,
            call.execution_id,
            call.turn,
            call.call_id,
            done.result,
            utcnow(),
            owner=rt.worker,
            token=call.attempts,
        ):
            return True
        if calls.is_held(conn, call.execution_id, call.turn, call.call_id):
            return True  # a retry after a lost connection: the first attempt held it
        calls.record_late_report(
            conn, call.execution_id, call.turn, call.call_id, done.outcome.value, done.result
        )
        return False


@dataclass(frozen=True)
class Settled:
    """A handler's result, settled in a transaction of its own (settle_one)."""

    #: "settled", "late" (the call had an outcome already, I12) or "held" (an interrupted call
    #: held for an operator)
    result: str
    #: the run's await tick, when this settle completed the turn of a run in await_tools (I7)
    await_version: int | None = None
    #: when it was settled, if in one statement (store.fused.settle_held): the commit after it
    #: may then know the call's row without reading it
    fused_at: datetime | None = None


def settle_result(rt: Runtime, done: CallResult) -> tuple[str, int | None]:
    """Settle a handler's result in a transaction of its own: ``("settled", await_version)``
    when it completed the turn, ``("settled" | "late", None)`` otherwise; ``("held", None)``
    for an interrupted call held for an operator."""
    settled = settle_one(rt, done)
    return settled.result, settled.await_version


def settle_one(rt: Runtime, done: CallResult) -> Settled:
    """settle_result, saying also whether it was settled in one statement, and when."""
    if held_for_operator(done):
        held = again_if_disconnected(lambda: _hold(rt, done), "hold an interrupted call")
        log.warning(
            "call held for an operator's verdict" if held else "late report",
            extra={"execution_id": done.call.execution_id, "call_id": done.call.call_id},
        )
        return Settled("held" if held else "late")
    at = utcnow()
    outcome = _settle_fused(rt, done, at)
    if outcome is not None:
        settled, await_version = outcome
        fused_at: datetime | None = at
    else:
        fused_at = None
        settled, await_version = again_if_disconnected(
            lambda: settle_in_turn(
                rt, done.call.execution_id, done.call.turn, _first_wins(rt, done)
            ),
            "settle a tool call",
        )
    log_settled(rt, done, settled)
    if await_version is not None:
        return Settled("settled", await_version, fused_at)
    return Settled("settled" if settled else "late", None, fused_at)


def _settle_fused(rt: Runtime, done: CallResult, at: datetime) -> tuple[bool, int | None] | None:
    """On PostgreSQL, a holder's settle in one statement (store.fused.settle_held), returned as
    settle_in_turn returns it; None when it settled nothing and the ordinary settle must run
    (a late report, a retry that finds its own commit, a held call's late holder)."""
    if not (rt.settings.fuse_commits and rt.engine.dialect.name == "postgresql"):
        return None
    call = done.call

    def settle() -> fused.HeldSettle | None:
        with write_one(rt.engine) as conn:
            return fused.settle_held(
                conn, call.execution_id, call.turn, call.call_id, done.outcome.value,
                done.result, rt.worker, at, done.duration_ms, call.attempts, at + rt.stall,
            )  # fmt: skip

    held = again_if_disconnected(settle, "settle a tool call")
    if rt.observer.enabled:
        safely(rt.observer.fused_commit, "settle_held", held is not None)
    if held is None:
        return None
    if held.phase == Phase.AWAIT_TOOLS.value and held.still_open == 0:
        return True, held.version
    return True, None


def _first_wins(rt: Runtime, done: CallResult) -> Callable[[Connection], bool]:
    """Settle the call, or record a late report when it has an outcome already (I12)."""
    call = done.call
    key = (call.execution_id, call.turn, call.call_id)
    outcome = done.outcome.value

    def settle(conn: Connection) -> bool:
        # Fenced by the lease the call was taken under: a holder whose lease lapsed and was
        # taken over (or settled) records at most a late report, never the outcome (I12).
        if calls.settle_call(
            conn,
            *key,
            outcome,
            done.result,
            rt.worker,
            utcnow(),
            done.duration_ms,
            token=call.attempts,
        ):
            return True
        if calls.settled_by(conn, *key) == rt.worker:
            return True  # a retry after a lost connection: the first attempt's commit went through
        if calls.settle_held_late(
            conn, *key, outcome, done.result, rt.worker, utcnow(), done.duration_ms, call.attempts
        ):
            # Its lease lapsed and the sweep held it for an operator, but nobody took it over:
            # this is the call's real and first result, and no verdict is needed any more.
            log.warning(
                "a held call's own holder reported: settled, hold ended",
                extra={"execution_id": call.execution_id, "call_id": call.call_id},
            )
            return True
        # I12/I13: it was settled meanwhile (deadline, interrupted, canceled): count it; a wait's
        # observation only if the late watch has not recorded that same end already.
        calls.record_late_report(conn, *key, outcome, done.result, first_only=call.resumable)
        return False

    return settle


def log_settled(rt: Runtime, done: CallResult, settled: bool, *, streamed: bool = False) -> None:
    """Report a call's settle (or late report) once it committed. ``streamed``: the commit was
    a tick's whose transition carried the settle, and streamed it already (a call settles once
    in the stream too)."""
    call = done.call
    report_call(
        rt,
        call.execution_id,
        call.turn,
        call.call_id,
        call.name,
        done.outcome.value,
        by=rt.worker,
        started=call.started_at,
        duration_ms=done.duration_ms,
        late=not settled,
    )
    log.info(
        "call settled" if settled else "late report",
        extra={
            "execution_id": call.execution_id,
            "call_id": call.call_id,
            "tool": call.name,
            "mode": done.mode,
            "outcome": done.outcome,
        },
    )
    if rt.events.enabled and not (settled and streamed):  # after the settle's commit (I28)
        # a late report is not a settle: the call had its outcome already (I12)
        rt.events.emit(
            task_id_of(call.execution_id),
            "tool_settled" if settled else "tool_late_report",
            event_id=settled_id(call.turn, call.call_id) if settled else None,
            turn=call.turn,
            call_id=call.call_id,
            name=call.name,
            outcome=done.outcome.value,
        )
    faults.hit("tool.after_settle", tool=call.name, call_id=call.call_id)


def report_call(
    rt: Runtime,
    execution_id: str,
    turn: int,
    call_id: str,
    tool: str,
    outcome: str,
    *,
    by: str,
    started: datetime | None,
    settled: datetime | None = None,
    duration_ms: float | None = None,
    late: bool = False,
) -> None:
    """Tell telemetry of one call's settlement (or late report), once it committed: every
    settler (a worker, the local call, a sweep, a person's verdict seen by the worker) reports
    through here. Telemetry never breaks the settle it reports."""
    if not rt.observer.enabled:
        return

    def emit() -> None:
        definition = rt.tools.get(tool)
        rt.observer.call_settled(
            CallEvent(
                task_id=task_id_of(execution_id),
                execution_id=execution_id,
                turn=turn,
                call_id=call_id,
                tool=tool,
                outcome=outcome,
                by=by,
                settled=settled.timestamp() if settled is not None else time.time(),
                started=started.timestamp() if started is not None else None,
                duration_ms=duration_ms,
                late=late,
                effect=definition.effect.value if definition is not None else None,
            )
        )

    safely(emit)


def report_settlements(rt: Runtime, view: RunView, settlements: list[Settlement]) -> None:
    """The calls a committed transition settled (deadlines, a stop's cancels)."""
    calls_by_id = {c.call_id: c for c in view.calls}
    for s in settlements:
        call = calls_by_id.get(s.call_id)
        report_call(
            rt,
            view.execution_id,
            view.turn,
            s.call_id,
            call.name if call else "?",
            s.outcome.value,
            by=rt.worker,
            started=call.started_at if call else None,
            duration_ms=s.duration_ms,
        )


def report_people_settled(rt: Runtime, view: RunView) -> None:
    """The calls of a turn that people settled (a deny, a reply, a reconcile): they settle in a
    producer's process, which reports nothing; the worker that takes the turn's results in
    reports them, once."""
    for call in view.calls:
        if call.outcome is None or not (call.settled_by or "").startswith("operator:"):
            continue
        report_call(
            rt,
            view.execution_id,
            view.turn,
            call.call_id,
            call.name,
            call.outcome.value,
            by=call.settled_by or "operator",
            started=call.started_at or call.queued_at or call.settled_at or view.now,
            settled=call.settled_at,
        )
