"""One tick: claim → boundary → phase → commit → publish (I1, I2, I5, I17, I18).

Phases without slow I/O run inside the claim's transaction. ``call_model`` and the report
phases claim in one short transaction, work outside any transaction while a heartbeat renews the
lease, and commit in a second one that succeeds only if the lease is still theirs.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

from charlie import faults
from charlie.domain import (
    ItemKind,
    Outcome,
    Phase,
    RunView,
    Settlement,
    Transition,
    task_id_of,
    utcnow,
)
from charlie.executor import boundary, fused, streamed
from charlie.executor.events import InlineReports
from charlie.executor.invoke import execute_call, poke_waiters, run_call
from charlie.executor.phases import needs
from charlie.executor.phases.mailbox import is_final_answer, reopen_final
from charlie.executor.settle import (
    CallResult,
    held_for_operator,
    log_settled,
    move_turn,
    recheck_at,
    report_people_settled,
    report_settlements,
    settle_one,
    settle_result,
)
from charlie.executor.steps import (
    MAX_MERGED,
    Carried,
    Follow,
    NextCalls,
    NextTick,
    Progress,
    StartCalls,
    Step,
    Wrote,
    compute,
    decide_at_boundary,
    local_call_ids,
    log_context,
    merges,
    merges_next,
    open_settlement,
    remember_transcript,
    starts_with_dispatch,
    view_of,
)
from charlie.observe import TickScope, safely
from charlie.runtime import Runtime
from charlie.store import calls, runs
from charlie.store.calls import ClaimedCall, Mode
from charlie.store.engine import again_if_disconnected, lose_connection, write, write_one
from charlie.store.types import Connection, DatabaseError, DriverError

log = logging.getLogger("charlie.tick")

SLOW_PHASES = frozenset({Phase.CALL_MODEL, Phase.REPORT_TERMINAL, Phase.REPORT_FAILURE})
#: Slow phases whose claim a merged transaction takes as its last write, for this worker to
#: work from right after the COMMIT: the model call, and the report of the final answer.
CARRIED = frozenset({Phase.CALL_MODEL, Phase.REPORT_TERMINAL})

TickResult = Literal["stale", "moved", "waiting", "lost_lease", "done", "refused"]

#: An inline chain stops after this long, whatever its step budget, and publishes its next step:
#: a Celery task stays well inside its time limit and other runs get their turn.
INLINE_SECONDS = 30.0
#: ... and not before it has run this long, once its step budget is spent: a stop costs a
#: publish, a claim and, in a prefork pool, often another process whose transcript cache does
#: not hold the run (its first model call then reads the transcript: 10 to 45 ms measured,
#: against 5 ms for a whole one-call turn). Steps that quick would otherwise stop their chain
#: every 15 turns, a tenth of a second; this bounds the stops of a short chain to twice a
#: second, and the time another run waits for the slot to half a second.
INLINE_MIN_SECONDS = 0.5


def _heartbeat(rt: Runtime, claim: runs.Claim) -> AbstractContextManager[object]:
    """Renew the run's lease while slow work runs (I5)."""

    def renew(conn: Connection) -> bool:
        until = utcnow() + timedelta(seconds=rt.settings.lease_seconds)
        return runs.renew_execution_lease(conn, claim.execution_id, claim.version, rt.worker, until)

    return rt.leases.held(renew, rt.settings.lease_seconds / 3, f"lease-{claim.execution_id}")


def _commit(
    rt: Runtime,
    conn: Connection,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    started: float,
    *,
    claim_next: bool = False,
) -> _Committed | None:
    """Commit the tick's transition; ``claim_next``: and claim the step after it for this
    worker in the same statement (a merged transaction's next step, see runs.claimed_next),
    reading on PostgreSQL what that claim would have read (runs.Fresh).
    Returns the time it recorded, or None, writing nothing, when the lease was lost."""
    error = None
    if transition.to is Phase.REPORT_FAILURE and transition.state:
        error = transition.state.get("error")
    now = utcnow()
    ok = runs.commit_transition(
        conn,
        claim,
        transition,
        owner=rt.worker,
        now=now,
        duration_ms=(time.perf_counter() - started) * 1000,
        error=error,
        next_lease_until=now + timedelta(seconds=rt.settings.lease_seconds) if claim_next else None,
        fresh=claim_next and _reads_fresh(conn),
    )
    if not ok:
        return None
    if transition.to is Phase.DONE and transition.state and "poison" in transition.state:
        runs.fail_poisoned_task(conn, view.task.id, transition.state["poison"], utcnow())
    return _Committed(now, ok if isinstance(ok, runs.Fresh) else None)


@dataclass(frozen=True)
class _Committed:
    at: datetime
    #: what the move read for the next step's claim (PostgreSQL, claim_next)
    fresh: runs.Fresh | None


@dataclass
class _Sent:
    """What a tick's transaction has done when it reaches its COMMIT: its first step's claim
    and the time its transition row records, to read the outcome back by."""

    claim: runs.Claim | None = None
    at: datetime | None = None


def _lost_after_commit(task_id: str, phase: Phase) -> Callable[[Connection], None] | None:
    """Fault point ``tick.commit.lost`` (tests, chaos): the server has committed the tick's
    transaction; an injected fault terminates its connection's backend for real, so the worker
    hears the driver's own error for a connection lost after the commit."""
    if not faults.enabled():
        return None

    def lost(conn: Connection) -> None:
        try:
            faults.hit("tick.commit.lost", task_id=task_id, phase=phase.value)
        except faults.InjectedFault:
            lose_connection(conn)

    return lost


def _committed_after_all(rt: Runtime, sent: _Sent, error: DriverError) -> bool:
    """A tick's COMMIT raised with its connection lost: the server may have committed it or
    not, so read back which, never assume (I1). Taken as nothing written, the tick would run
    again to find its own step gone: a local call's result recorded as a late report (false
    evidence, I12) and the next step's claim, this worker's, orphaned until its lease lapsed."""
    claim, at = sent.claim, sent.at
    if claim is None or at is None or not error.connection_invalidated:
        return False

    def read_back() -> bool:
        with write_one(rt.engine) as conn:
            return runs.transition_recorded(
                conn, claim.execution_id, claim.version + 1, rt.worker, at
            )

    applied = again_if_disconnected(read_back, "read back a tick's commit")
    log.warning(
        "tick commit read back: %s",
        "it was committed before its connection was lost" if applied else "not applied",
        extra={"execution_id": claim.execution_id, "version": claim.version},
    )
    return applied


def _reads_fresh(conn: Connection) -> bool:
    """Whether a move that claims its next step reads what that claim would have (the task's
    status, the mailbox, a budget): on PostgreSQL, in the move's own statement. SQLite
    serializes writers for the whole transaction, so there nothing changed since its claim."""
    return conn.dialect.name == "postgresql"


def _rides(
    rt: Runtime, conn: Connection, progress: Progress, claim: runs.Claim, transition: Transition
) -> bool:
    """Whether this transition's move also claims the step after it: a fast step a
    merged transaction runs whole (_merges_next) or, on PostgreSQL, a carried slow phase's
    claim that ends the transaction (call_model's, report_terminal's: they need the task's
    status, the mailbox and the budget as they are now, which the move reads, runs.Fresh)."""
    if merges_next(claim, transition):
        return True
    return (
        _reads_fresh(conn)
        and transition.to in CARRIED
        and transition.publish_next
        and transition.wake_at is None
        and progress.inline
        and not transition.queue_calls
    )


def _publish(
    rt: Runtime,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    *,
    publish_next: bool = True,
    local_calls: tuple[str, ...] = (),
) -> None:
    faults.hit(
        "tick.after_commit",
        phase=claim.phase.value,
        task_id=view.task.id,
        messages=len(transition.take_messages),
    )
    messages: list[tuple[str, tuple[object, ...]]] = []
    for call_id, _deadline in transition.queue_calls:
        if call_id not in local_calls:
            messages.append(
                ("charlie.tool.invoke", (claim.execution_id, claim.turn, call_id, "start"))
            )
    names = {c.call_id: c.name for c in view.calls}
    for settled in transition.settle:
        # A stop canceled the call: its tool may stop the outside work its handle names (an
        # MCP task). Best effort: lost, the work runs on, as a deadline leaves it (I13).
        definition = rt.tools.get(names.get(settled.call_id, ""))
        if settled.outcome is Outcome.CANCELED and definition and definition.cancel:
            messages.append(
                ("charlie.tool.invoke", (claim.execution_id, claim.turn, settled.call_id, "cancel"))
            )
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
            rt.publisher.many(messages, priority=claim.priority)
        except Exception:
            log.exception("publish failed after commit; the sweep will re-publish")


def invoke(rt: Runtime, execution_id: str, turn: int, call_id: str, mode: Mode) -> str:
    """The ``charlie.tool.invoke`` task: run the call, then, if it completed the turn, the
    run's await tick (here, with inline phases; else published, see settle.move_turn)."""
    with rt.observer.invocation(execution_id, turn, call_id):
        result, await_version = run_call(rt, execution_id, turn, call_id, mode)
    if await_version is not None:
        move_turn(rt, execution_id, await_version, lambda xid, v: advance_awaiting_run(rt, xid, v))
    return result


def advance_awaiting_run(rt: Runtime, execution_id: str, version: int) -> str:
    """Run a run's await tick in this worker, inside the task that settled its turn."""
    return run_tick(rt, execution_id, Phase.AWAIT_TOOLS, version, inline_first=True)


def run_tick(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    *,
    durable_claim: bool = False,
    inline_first: bool = False,
) -> str:
    """Run one tick, then, with ``CHARLIE_INLINE_PHASES``, the steps that follow it.

    A following step is the run's next phase, or the turn's only tool call. Inline, each is
    still claimed and committed on its own, each phase recorded as its own transition, and each
    call marked started before its handler runs (I9); only the publish (and the trip through
    the broker) is skipped, and Flower hears of the step as a task of its own (I21). A crash
    between two steps is a commit whose message was never published, which the sweep finds
    (I4). ``inline_first``: this tick itself runs inside another task (the tool invocation that
    settled a turn)."""
    budget = rt.settings.inline_phases
    started = time.monotonic()
    deadline, floor = started + INLINE_SECONDS, started + INLINE_MIN_SECONDS
    step: Follow = NextTick(phase, version)
    inline = inline_first
    reports = InlineReports(rt)
    try:
        while True:
            chain = chain_goes_on(
                rt.settings.inline_phases, budget, floor, deadline, time.monotonic()
            )
            result: str
            follow: Follow | None
            if isinstance(step, NextTick):
                reporting = (
                    reports.task(f"charlie.phase.{step.phase.value}", (execution_id, step.version))
                    if inline
                    else nullcontext()
                )
                progress = Progress(
                    inline=chain,
                    durable_claim=durable_claim,
                    carried=step.carried,
                    reports=reports,
                )
                with reporting as report:
                    result, follow = _guarded_tick(
                        rt, execution_id, step.phase, step.version, progress=progress
                    )
                    if report is not None:
                        report.result = result
            else:
                # The chain stops before the next model call's claim, not after it: a budget
                # that only lasts for that step would run it without its local calls (published,
                # the turn split between workers); stopping here publishes the next call_model
                # tick. The handlers may have run long: the chain's time limit counts them.
                result, follow = _run_local(
                    rt,
                    execution_id,
                    step,
                    reports,
                    _chain_check(rt, budget, floor, deadline),
                )
            if follow is None:
                return result
            step = follow
            budget -= 1
            durable_claim = False
            inline = True
    finally:
        reports.send()


def _lease_still_ours(rt: Runtime, claim: runs.Claim, claimed: float) -> bool:
    """A claim carried from a merged transaction was taken before that transaction's publishes
    and reports: if they took a third of the lease (a broker slow to answer), renew it before
    the model is called, so no other worker takes the run meanwhile (I5); else no statement."""
    if time.perf_counter() - claimed < rt.settings.lease_seconds / 3:
        return True
    until = utcnow() + timedelta(seconds=rt.settings.lease_seconds)
    with write_one(rt.engine) as conn:
        renewed = runs.renew_execution_lease(
            conn, claim.execution_id, claim.version, rt.worker, until
        )
    if not renewed:
        log.warning("the lease of a carried call_model claim lapsed before the model call")
    return renewed


def chain_goes_on(
    inline_phases: int, budget: int, floor: float, deadline: float, now: float
) -> bool:
    """Whether a chain runs its next step itself: never with inline steps off
    (CHARLIE_INLINE_PHASES=0), never past its deadline (INLINE_SECONDS), and otherwise while
    its step budget lasts or until its floor (INLINE_MIN_SECONDS after it started)."""
    if inline_phases <= 0:
        return False
    return now < deadline and (budget > 0 or now < floor)


def _chain_check(rt: Runtime, budget: int, floor: float, deadline: float) -> Callable[[], bool]:
    """Whether, once the local calls are done, the chain may go on to the next model call."""
    inline = rt.settings.inline_phases
    return lambda: chain_goes_on(inline, budget - 1, floor, deadline, time.monotonic())


def _start_calls(rt: Runtime, execution_id: str, step: StartCalls) -> tuple[ClaimedCall, ...]:
    """Mark the local calls started, in one commit before their handlers run (I9): those still
    startable (its task stopped, I18, or a deadline passed: none of them, nothing to run)."""
    faults.hit(
        "tick.merged.before_start", call_id=step.call_ids[0], task_id=task_id_of(execution_id)
    )
    return again_if_disconnected(
        lambda: calls.claim_calls_alone(
            rt.engine,
            execution_id,
            step.turn,
            step.call_ids,
            rt.worker,
            rt.settings.lease_seconds,
            implementations=rt.tools.implementations(),
            fused=rt.settings.fuse_commits,
        ),
        "start the local tool calls",
    )


def _run_local(
    rt: Runtime,
    execution_id: str,
    step: NextCalls | StartCalls,
    reports: InlineReports,
    chain_next: Callable[[], bool],
) -> tuple[str, Follow | None]:
    """Run the turn's local calls here (one, or several at once, a thread each), settle each as
    it ends in a commit of its own (I7, I12: first result wins, each independently), and the
    last in the await tick's transaction, which carries the turn on (see _settle_local_call):
    a turn of K calls in at most K + 2 commits. ``chain_next``: whether the chain
    may go on to the next model call after them."""
    if isinstance(step, StartCalls):
        started = _start_calls(rt, execution_id, step)
        if not started:
            return "not_claimable", None
        safely(
            streamed.calls_started,
            rt.events,
            task_id_of(execution_id),
            step.turn,
            [c.call_id for c in started],
        )
        predicted = step.predicted
        if predicted is not None:
            # (a call that did not start makes the turn's next commit read the rows)
            whole = len(started) == len(step.call_ids)
            predicted = predicted.started(started, rt.worker) if whole else None
        step = NextCalls(started, step.await_version, predicted)
    predicted = step.predicted
    left = len(step.calls)
    result = "settled"
    turn_done: int | None = None
    for call, done in _run_batch(rt, execution_id, step.calls, reports):
        left -= 1
        if isinstance(done, str):
            # parked, asking, lost its lease: not settled here, so the turn is not done here
            predicted, result = None, done
            continue
        if left > 0 or turn_done is not None:
            with rt.observer.invocation(execution_id, call.turn, call.call_id):
                settled = settle_one(rt, done)
            if settled.await_version is not None:
                # the others were settled meanwhile (a deadline, a stop): this was the last
                turn_done = settled.await_version
            if predicted is not None:
                at = settled.fused_at
                predicted = predicted.settled(done, rt.worker, at) if at else None
            continue
        with (
            reports.task("charlie.phase.await_tools", (execution_id, step.await_version)) as report,
            rt.observer.invocation(execution_id, call.turn, call.call_id),  # its log lines too
        ):
            result, follow = _settle_local_call(
                rt,
                execution_id,
                replace(step, predicted=predicted),
                done,
                chain=chain_next(),
                reports=reports,
            )
            report.result = result
        return result, follow
    if turn_done is not None:
        if chain_next():
            return "settled", NextTick(Phase.AWAIT_TOOLS, turn_done)
        move_turn(rt, execution_id, turn_done)
    return result, None


def _run_batch(
    rt: Runtime, execution_id: str, calls: tuple[ClaimedCall, ...], reports: InlineReports
) -> Iterator[tuple[ClaimedCall, CallResult | str]]:
    """Each call's handler run (I9: each started already), as each ends: one here, several at
    once, each in a thread of its own (their tools are threadsafe, steps.local_call_ids)."""
    if len(calls) == 1:
        yield calls[0], _execute_local(rt, execution_id, calls[0], reports)
        return
    with ThreadPoolExecutor(len(calls), thread_name_prefix="charlie-call") as pool:
        running = {}
        for call in calls:
            # each in a copy of this context: a thread starts with none (the trace's)
            context = contextvars.copy_context()
            future = pool.submit(context.run, _execute_local, rt, execution_id, call, reports)
            running[future] = call
        for future in as_completed(running):
            yield running[future], future.result()


def _execute_local(
    rt: Runtime, execution_id: str, call: ClaimedCall, reports: InlineReports
) -> CallResult | str:
    args = (execution_id, call.turn, call.call_id, "start")
    with (
        reports.task("charlie.tool.invoke", args) as report,
        rt.observer.invocation(execution_id, call.turn, call.call_id),
    ):
        done = execute_call(rt, call, "start")
        report.result = done if isinstance(done, str) else "settled"
    return done


def _settle_local_call(
    rt: Runtime,
    execution_id: str,
    step: NextCalls,
    done: CallResult,
    *,
    chain: bool,
    reports: InlineReports | None = None,
) -> tuple[str, Follow | None]:
    """Settle a local call's result in the await tick's own transaction (the settle, the turn's
    completion and the move on commit together, and, merged, the steps after it up to the next
    model call's claim, which is not taken when the chain must stop: ``chain`` False publishes
    it), or on its own if that tick cannot run here (an interrupted call held for an operator
    never completes the turn: on its own)."""
    if not held_for_operator(done):
        progress = Progress(
            inline=chain, settlement=done, reports=reports, predicted=step.predicted
        )
        moved, follow = _guarded_tick(
            rt, execution_id, Phase.AWAIT_TOOLS, step.await_version, progress=progress
        )
        if progress.settled is not None:
            # the tick's committed transition carried the settle, and streamed it
            log_settled(rt, done, progress.settled, streamed=True)
            return moved, follow
    settled, await_version = settle_result(rt, done)
    if await_version is None:
        return settled, None
    if chain:
        return settled, NextTick(Phase.AWAIT_TOOLS, await_version)
    move_turn(rt, execution_id, await_version)  # no time left to run it here: published
    return settled, None


def _guarded_tick(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    *,
    inline: bool = False,
    durable_claim: bool = False,
    progress: Progress | None = None,
) -> tuple[TickResult, Follow | None]:
    if progress is None:
        progress = Progress(inline=inline, durable_claim=durable_claim)
    progress.scope = scope = TickScope(execution_id, phase, version, rt.worker)
    with rt.observer.tick(scope):
        scope.result, follow = _observed_tick(rt, execution_id, phase, version, progress)
        return scope.result, follow


def _observed_tick(
    rt: Runtime, execution_id: str, phase: Phase, version: int, progress: Progress
) -> tuple[TickResult, Follow | None]:
    try:
        try:
            return _run_tick(rt, execution_id, phase, version, progress)
        except DriverError as exc:
            if not exc.connection_invalidated or progress.claim_committed:
                raise
            # A pooled connection that died (a database restart) fails its first statement;
            # the pool has since dropped its peers. Nothing was committed: run the tick again.
            log.warning(
                "database connection lost; running the tick again",
                extra={"execution_id": execution_id, "phase": phase.value, "version": version},
            )
            progress.claim_committed = False
            return _run_tick(rt, execution_id, phase, version, progress)
    except DatabaseError as exc:
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
                    recheck_at=recheck_at(rt),
                )
        except DatabaseError:
            log.warning("could not record the refused write either; the lease will lapse")
        return "refused", None


def _follow(
    progress: Progress,
    claim: runs.Claim,
    transition: Transition,
    local: tuple[ClaimedCall, ...],
    start_apart: tuple[str, ...] = (),
) -> Follow | None:
    """What this worker does next itself, if inline steps are allowed."""
    if not progress.inline:
        return None
    to = transition.to
    if to is not None and to is not Phase.DONE and transition.publish_next:
        return NextTick(to, claim.version + 1)
    if local:
        return NextCalls(local, claim.version + 1)
    if start_apart:
        return StartCalls(claim.turn, start_apart, claim.version + 1)
    return None


def _take_settlement(
    rt: Runtime, conn: Connection, view: RunView, done: CallResult
) -> tuple[RunView, Settlement | None]:
    """Apply a call's result to the view the phase sees (steps.open_settlement); a call settled
    meanwhile (a deadline, a cancel), or taken over after this worker's lease lapsed, gets a
    late report instead (I12, I13). The turn's calls are locked in this
    transaction, so what is checked here is what commits."""
    view, settlement = open_settlement(rt, view, done)
    if settlement is None:
        call = done.call
        calls.record_late_report(
            conn, call.execution_id, call.turn, call.call_id, done.outcome.value, done.result
        )
    return view, settlement


def _claim(
    rt: Runtime, conn: Connection, execution_id: str, phase: Phase, version: int
) -> tuple[runs.Claim, datetime] | None:
    # The time is taken after BEGIN: on SQLite the write lock may take a while, and a lease
    # computed before waiting for it could be born expired.
    now = utcnow()
    claim = runs.claim_execution(
        conn, execution_id, phase, version, rt.worker, now, rt.settings.lease_seconds
    )
    if claim is None:
        log.debug("stale tick %s %s v%s", execution_id, phase.value, version)
        return None
    if claim.task is None:
        log.error("execution %s has no task row", execution_id)
        return None
    return claim, now


def _report_calls(rt: Runtime, progress: Progress, view: RunView, transition: Transition) -> None:
    if view.phase is Phase.ADVANCE_TURN and transition.next_turn:
        report_people_settled(rt, view)
    if transition.settle:
        local_result = progress.settlement.call.call_id if progress.settlement else None
        # (the local call's own settle is reported by log_settled, with its late report)
        report_settlements(rt, view, [s for s in transition.settle if s.call_id != local_result])


def _observed(rt: Runtime, progress: Progress, claim: runs.Claim, transition: Transition) -> None:
    scope = progress.scope
    if scope is not None:
        scope.task_id = claim.task_id
        scope.turn = claim.turn
        scope.attempts = claim.attempts
        scope.to = transition.to
        scope.model_calls = transition.model_calls
        scope.model_repeats = transition.model_repeats
        scope.note = transition.note
        if rt.observer.enabled and transition.items:
            scope.results = tuple(
                (str(i.payload.get("name")), str(i.payload.get("outcome")))
                for i in transition.items
                if i.kind is ItemKind.TOOL_RESULT
            )
            scope.compactions = tuple(
                (
                    str(i.payload.get("model")),
                    int(i.payload.get("tokens_before") or 0),
                    int(i.payload.get("tokens_after") or 0),
                )
                for i in transition.items
                if i.kind is ItemKind.COMPACTION
            )


def _start_local(
    rt: Runtime, conn: Connection, view: RunView, local_ids: tuple[str, ...]
) -> tuple[ClaimedCall, ...]:
    """Mark the turn's calls this worker runs itself started in the dispatch's transaction, to
    run here (I9): those still startable (a task stopped since the claim starts none, I18).
    Only reads (steps.starts_with_dispatch): a write's or a wait's start commits on its own."""
    started = []
    for local_id in local_ids:
        call = calls.start_local_call(
            conn,
            view.execution_id,
            view.turn,
            local_id,
            rt.worker,
            rt.settings.lease_seconds,
            implementations=rt.tools.implementations(),
        )
        if call is not None:
            started.append(call)
    return tuple(started)


def _merge(
    rt: Runtime,
    conn: Connection,
    progress: Progress,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    committed: _Committed,
    local: tuple[ClaimedCall, ...],
    wrote: list[Wrote],
    *,
    claimed: bool = False,
    local_ids: tuple[str, ...] = (),
) -> tuple[list[Step], Carried | None]:
    """After a transition's compare-and-set, before COMMIT: run in the same transaction the
    steps that follow it while nothing outside the database has to happen first.

    Each merged step is a tick of its own in all but the COMMIT: its claim's compare-and-set on
    (phase, version), its boundary, its phase, its own ``transitions`` row and version + 1 (I1,
    I21). The transaction ends where something outside the database comes next: a model call
    (call_model's claim, with its attempt and this worker's lease, is the last write: it
    commits before the model is called, I3, I5), a tool handler (a merged dispatch queues the
    turn's only call, which is marked started in a commit of its own just after, I9), a publish
    (a fan-out's invocations, a wait: after the COMMIT, I1). Only a first try merges
    (``claim.attempts == 1``): a step that runs again after a crash or a refused write commits
    on its own, so a step that kills its worker is counted in its own phase and poisons there,
    and repeats at most one model call (the counted repeat) on its way."""
    steps: list[Step] = []
    if not merges(rt, claim, progress, bool(local or local_ids)):
        return steps, None
    first = claim.phase.value  # the fault points name the transaction by its first step
    while len(steps) < MAX_MERGED:
        to = transition.to
        if claimed:
            pass  # the move claimed it (_merges_next)
        elif to in CARRIED and transition.publish_next and transition.wake_at is None:
            if not progress.inline:
                break  # its tick is published: this worker will not call the model
        elif not merges_next(claim, transition):
            break
        if to is None:
            break
        faults.hit("tick.merged.step", phase=to.value, task_id=claim.task_id, first=first)
        started = time.perf_counter()
        if claimed:
            next_claim = runs.claimed_next(claim, transition, committed.fresh, conn)
            now = utcnow()
        else:
            taken = _claim(rt, conn, claim.execution_id, to, claim.version + 1)
            if taken is None:
                break
            next_claim, now = taken
        # The turn's calls are this transaction's (inserted or locked by it): no read for them.
        known = runs.calls_as_left(
            claim,
            view.calls if claim.phase in boundary.TOOL_PHASES else None,
            transition,
            now=committed.at,
            owner=rt.worker,
            dialect=conn.dialect.name,
        )
        view = view_of(rt, conn, next_claim, now, known, wrote)
        progress.merged += 1
        if to in CARRIED:
            # The claim is the transaction's last write; its slow work (the model call, the
            # report) runs after COMMIT, with no transaction open (I5).
            return steps, Carried(next_claim, view, started)
        next_transition = _fast_phase(rt, to, view)
        # Local calls are not started here but in a commit of their own once this one is done
        # (StartCalls): a worker killed between the two leaves them pending, free to start
        # (I11).
        local_ids = local_call_ids(rt, progress, view, next_transition)
        claimed = (
            not local_ids
            and len(steps) + 1 < MAX_MERGED
            and _rides(rt, conn, progress, next_claim, next_transition)
        )
        at = _commit(rt, conn, next_claim, view, next_transition, started, claim_next=claimed)
        if at is None:
            # This transaction took the lease a moment ago and holds the row.
            raise RuntimeError(f"run {claim.execution_id}: a merged step lost its own lease")
        committed = at
        wrote.append((next_claim.next_seq, runs.written_items(conn, next_claim, next_transition)))
        steps.append(Step(next_claim, view, next_transition, local_ids))
        if local_ids:
            break
        claim, transition = next_claim, next_transition
    return steps, None


#: Why a tick ended without committing its transition: its claim was stale, or its lease was
#: lost (nothing to publish or report).
_Unmoved = Literal["stale", "lost_lease"]


@dataclass(frozen=True)
class _Ticked:
    """What a tick's commit did, for what follows it: its own step (the claim, the view its
    phase saw, the transition), the steps merged after it in the same transaction, and the
    turn's local calls that commit started or left to start in a commit of their own."""

    claim: runs.Claim
    view: RunView
    transition: Transition
    merged: list[Step]
    carried: Carried | None
    wrote: list[Wrote]
    local: tuple[ClaimedCall, ...] = ()
    #: local calls to start in a commit of their own after this one (writes, waits)
    start_apart: tuple[str, ...] = ()
    #: the local call's result the commit settled (None: none, or a late report)
    settlement: Settlement | None = None


def _run_tick(
    rt: Runtime, execution_id: str, phase: Phase, version: int, progress: Progress
) -> tuple[TickResult, Follow | None]:
    """Claim, run the phase and commit (with the steps merged after it), then do what the
    commit allows: its publishes, telemetry, and what this worker does next."""
    started = time.perf_counter()
    progress.merged = 0
    if phase in SLOW_PHASES:
        ticked = _slow_tick(rt, execution_id, phase, version, progress, started)
    else:
        ticked = _fast_tick(rt, execution_id, phase, version, progress, started)
    if isinstance(ticked, str):
        return ticked, None
    _merged_end(progress, ticked.claim, ticked.merged, ticked.carried, "tick.merged.after_commit")
    if ticked.merged or ticked.carried is not None:
        return "moved", _after_merged_commit(rt, progress, ticked)
    return _after_own_commit(rt, progress, ticked)


def _slow_tick(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    started: float,
) -> _Ticked | _Unmoved:
    """A slow phase: claimed in a commit of its own (or carried), worked outside any
    transaction, committed in a second one (or one fused statement, fused.model_turn)."""
    held = _hold_slow_claim(rt, execution_id, phase, version, progress, started)
    if isinstance(held, str):
        return held
    claim, view, started = held
    progress.claim_committed = True
    transition = _slow_work(rt, phase, claim, view)
    fused_commit = fused.model_turn(rt, progress, claim, view, transition, started)
    if fused_commit is not None:
        merged, carried = fused_commit.merged, fused_commit.carried
        remember_transcript(rt, claim, view.items, fused_commit.wrote, carried)
        return _Ticked(claim, view, transition, merged, carried, fused_commit.wrote)
    ticked = _commit_slow(rt, execution_id, phase, progress, claim, view, transition, started)
    if isinstance(ticked, str):
        return ticked
    items = view.items if "items" in needs(phase) else None
    remember_transcript(rt, claim, items, ticked.wrote, ticked.carried)
    return ticked


def _hold_slow_claim(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    started: float,
) -> tuple[runs.Claim, RunView, float] | _Unmoved:
    """The slow phase's claim, committed before its work: the one carried from the merged
    transaction before it, or one of its own. With its view, and when its step started."""
    if progress.carried is not None:
        # Claimed (attempt counted, lease ours) in the transaction that merged the steps
        # before this one: from here until the commit no transaction is open (I5).
        claim, view, started = (
            progress.carried.claim,
            progress.carried.view,
            progress.carried.started,
        )
        if not _lease_still_ours(rt, claim, started):
            return "lost_lease"
    else:
        # The claim commits on its own (on a server database each statement in autocommit,
        # so without BEGIN and COMMIT round trips); from there until the commit no
        # transaction is open (I5), and the attempt it counted stands even if this worker
        # dies.
        with write_one(rt.engine) as conn:
            claimed = _claim(rt, conn, execution_id, phase, version)
            if claimed is None:
                return "stale"
            claim, now = claimed
            view = view_of(rt, conn, claim, now)
    return claim, view, started


def _slow_work(rt: Runtime, phase: Phase, claim: runs.Claim, view: RunView) -> Transition:
    """The boundary's decision, or else the phase's slow work (the model call, the report),
    with no transaction open while a heartbeat renews the lease (I5)."""
    transition = decide_at_boundary(rt, view)
    if transition is None:
        faults.hit("tick.before_work", phase=phase.value, task_id=view.task.id)
        with _heartbeat(rt, claim):
            transition = compute(rt, view)
        faults.hit("tick.before_commit", phase=phase.value, task_id=view.task.id)
        left = transition.to is Phase.REPORT_FAILURE
    else:
        left = transition.to not in (None, Phase.CALL_MODEL)
    if left and phase is Phase.CALL_MODEL and "capacity" in view.state:
        # I30: a call that waited for capacity leaves without a slot (canceled, stopped, over
        # budget, failed): its wait ends, the room it may have been woken for passed on.
        rt.deps.capacity.leave(view)
    return transition


def _commit_slow(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    progress: Progress,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    started: float,
) -> _Ticked | _Unmoved:
    """The slow phase's second transaction; a COMMIT whose connection was lost is read back,
    never assumed either way (I1)."""
    sent = _Sent()
    try:
        with write(rt.engine, _lost_after_commit(view.task.id, phase)) as conn:
            ticked = _slow_transaction(
                rt, conn, execution_id, phase, progress, claim, view, transition, started, sent
            )
    except DriverError as error:
        if not _committed_after_all(rt, sent, error):
            raise
    return ticked


def _slow_transaction(
    rt: Runtime,
    conn: Connection,
    execution_id: str,
    phase: Phase,
    progress: Progress,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    started: float,
    sent: _Sent,
) -> _Ticked | _Unmoved:
    """Up to its COMMIT: the slow phase's result (with the mail a final answer must take in),
    its move, and the steps merged after it."""
    transition = _reopen_final_for_mail(conn, execution_id, phase, view, transition)
    # This claim's task view is as old as the model call: a stop committed
    # meanwhile must be seen at the next step's boundary (I18), so the next step
    # claims the run itself, or (PostgreSQL) the move reads the task as it is now
    # (runs.Fresh).
    claim_next = (
        _reads_fresh(conn)
        and merges(rt, claim, progress)
        and _rides(rt, conn, progress, claim, transition)
    )
    at = _commit(rt, conn, claim, view, transition, started, claim_next=claim_next)
    if at is None:
        log.warning("lease lost during %s; discarding its result", phase.value)
        return "lost_lease"
    wrote = [(claim.next_seq, runs.written_items(conn, claim, transition))]
    merged, carried = _merge(
        rt,
        conn,
        progress,
        claim,
        view,
        transition,
        at,
        (),
        wrote,
        claimed=claim_next,
    )
    _merged_end(progress, claim, merged, carried, "tick.merged.end")
    sent.claim, sent.at = claim, at.at
    return _Ticked(claim, view, transition, merged, carried, wrote)


def _reopen_final_for_mail(
    conn: Connection, execution_id: str, phase: Phase, view: RunView, transition: Transition
) -> Transition:
    """A model's final answer, or, when mail is waiting, the model called again with it."""
    # A final answer while mail waits is not final (I22): the messages sent while
    # the model wrote it go in now, and the model answers again; report_terminal
    # itself never calls the model (I16). Sends lock the run's row too, so one
    # committed after this lock finds the run finishing and is refused.
    if (
        phase is Phase.CALL_MODEL
        and transition.to is Phase.REPORT_TERMINAL
        and is_final_answer(transition)  # (a stop took its mail in itself)
        and calls.lock_run_inbox(conn, execution_id) > 0
    ):
        mail = runs.load_messages(conn, view.task.id)
        transition = reopen_final(replace(view, messages=mail), transition)
    return transition


def _fast_tick(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    started: float,
) -> _Ticked | _Unmoved:
    """A fast phase: its claim, reads, phase and commit in one transaction (or the turn's
    local call settled in one fused statement, fused.settle_turn)."""
    fused_commit = (
        fused.settle_turn(rt, progress, started)
        if progress.predicted is not None
        and progress.predicted.claim.phase is phase
        and progress.predicted.claim.version == version
        else None
    )
    if fused_commit is not None:
        claim, view, transition = (
            fused_commit.claim,
            fused_commit.view,
            fused_commit.transition,
        )
        merged, carried = fused_commit.merged, fused_commit.carried
        remember_transcript(rt, claim, None, fused_commit.wrote, carried)
        progress.claim_committed = True
        progress.settled = True
        return _Ticked(claim, view, transition, merged, carried, fused_commit.wrote)
    claimed = None
    if progress.durable_claim:
        # A redelivered message may be the one that killed the last worker: count this
        # attempt in a commit of its own before running the phase (poison messages).
        with write_one(rt.engine) as conn:
            claimed = _claim(rt, conn, execution_id, phase, version)
        if claimed is None:
            return "stale"
        progress.claim_committed = True
    ticked = _commit_fast(rt, execution_id, phase, version, progress, claimed, started)
    if isinstance(ticked, str):
        return ticked
    items = ticked.view.items if "items" in needs(phase) else None
    remember_transcript(rt, ticked.claim, items, ticked.wrote, ticked.carried)
    progress.claim_committed = True
    if progress.settlement is not None:
        progress.settled = ticked.settlement is not None
    return ticked


def _commit_fast(
    rt: Runtime,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    claimed: tuple[runs.Claim, datetime] | None,
    started: float,
) -> _Ticked | _Unmoved:
    """A fast phase runs inside one transaction with its reads (the turn's calls locked)
    and its commit; a COMMIT whose connection was lost is read back, never assumed (I1)."""
    sent = _Sent()
    try:
        with write(rt.engine, _lost_after_commit(task_id_of(execution_id), phase)) as conn:
            ticked = _fast_transaction(
                rt, conn, execution_id, phase, version, progress, claimed, started, sent
            )
    except DriverError as error:
        if not _committed_after_all(rt, sent, error):
            raise
    return ticked  # the transaction reached its commit (sent)


def _fast_transaction(
    rt: Runtime,
    conn: Connection,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    claimed: tuple[runs.Claim, datetime] | None,
    started: float,
    sent: _Sent,
) -> _Ticked | _Unmoved:
    """Up to its COMMIT: the claim, the phase (with the local call's result, if any), the
    move, the local calls' start, and the steps merged after it."""
    claimed = _claim_fast(rt, conn, execution_id, phase, version, progress, claimed)
    if claimed is None:
        return "stale"
    claim, now = claimed
    view = view_of(rt, conn, claim, now)
    # the calls as read, before a local result is applied (the commit's SETTLE
    # applies it in the table, and calls_as_left in what the next merged step sees)
    loaded = view
    settlement = None
    if progress.settlement is not None:
        view, settlement = _take_settlement(rt, conn, view, progress.settlement)
    transition = _fast_phase(rt, phase, view)
    if settlement is not None:
        transition.settle.append(settlement)
    local_ids = local_call_ids(rt, progress, view, transition)
    claim_next = (
        not local_ids
        and merges(rt, claim, progress)
        and _rides(rt, conn, progress, claim, transition)
    )
    at = _commit(rt, conn, claim, view, transition, started, claim_next=claim_next)
    if at is None:
        return "lost_lease"
    local: tuple[ClaimedCall, ...] = ()
    start_apart: tuple[str, ...] = ()
    # Reads start in this commit; a write's or a wait's start commits on its own
    # after it (StartCalls), so a crash in between leaves it pending, free to
    # start (I11), never an uncertain write (I10).
    if starts_with_dispatch(rt, view, local_ids):
        local = _start_local(rt, conn, view, local_ids)
    else:
        start_apart = local_ids
    wrote = [(claim.next_seq, runs.written_items(conn, claim, transition))]
    merged, carried = _merge(
        rt, conn, progress, claim, loaded, transition, at, local, wrote,
        claimed=claim_next, local_ids=local_ids,
    )  # fmt: skip
    _merged_end(progress, claim, merged, carried, "tick.merged.end")
    sent.claim, sent.at = claim, at.at
    return _Ticked(
        claim, view, transition, merged, carried, wrote,
        local=local, start_apart=start_apart, settlement=settlement,
    )  # fmt: skip


def _claim_fast(
    rt: Runtime,
    conn: Connection,
    execution_id: str,
    phase: Phase,
    version: int,
    progress: Progress,
    claimed: tuple[runs.Claim, datetime] | None,
) -> tuple[runs.Claim, datetime] | None:
    """The fast phase's claim, taken in its transaction; or, a durable claim having committed
    apart, the run's row locked again in this one."""
    if not progress.durable_claim:
        claimed = _claim(rt, conn, execution_id, phase, version)
        if claimed is None:
            return None
    assert claimed is not None
    claim, now = claimed
    if progress.durable_claim:
        # The claim committed apart, so this transaction holds no lock on the run
        # yet: take it before the calls, in the order settlers take them (no
        # deadlock), and its mailbox as it is now: a send may have committed
        # since the claim.
        inbox = calls.lock_run_inbox(conn, execution_id)
        claim = replace(claim, inbox=max(claim.inbox, inbox))
    return claim, now


def _fast_phase(rt: Runtime, phase: Phase, view: RunView) -> Transition:
    """The boundary's decision, or else the phase itself, run in the claim's transaction."""
    transition = decide_at_boundary(rt, view)
    if transition is None:
        transition = compute(rt, view)
        faults.hit(
            "tick.in_transaction",
            phase=phase.value,
            task_id=view.task.id,
            messages=len(transition.take_messages),
        )
    return transition


def _after_merged_commit(rt: Runtime, progress: Progress, ticked: _Ticked) -> Follow | None:
    """After a merged transaction's commit: each of its steps' publishes, log line and
    telemetry, as its own tick would have done them (I21); returns the last one's follow."""
    claim, view, transition = ticked.claim, ticked.view, ticked.transition
    merged, carried = ticked.merged, ticked.carried
    # What each merged step does after the commit, in order; the chain goes on from the last.
    started = tuple(c.call_id for c in ticked.local)
    _after_commit(rt, claim, view, transition, (), publish_next=False, started=started)
    _report_tick(rt, progress, claim, view, transition)
    for step in merged[:-1]:
        _report_merged(rt, progress, step, None, publish_next=False)
    if merged:
        last = merged[-1]
        follow = _carried_follow(carried) or _merged_follow(progress, last)
        _report_merged(rt, progress, last, follow, publish_next=not isinstance(follow, NextTick))
    else:
        follow = _carried_follow(carried)
    return follow


def _after_own_commit(
    rt: Runtime, progress: Progress, ticked: _Ticked
) -> tuple[TickResult, Follow | None]:
    """After a commit of one step: its publishes, its log line, telemetry, and its follow."""
    claim, view, transition = ticked.claim, ticked.view, ticked.transition
    local, start_apart = ticked.local, ticked.start_apart
    follow = _follow(progress, claim, transition, local, start_apart)
    started = tuple(c.call_id for c in local)
    result = _after_commit(
        rt, claim, view, transition, started + start_apart, follow=follow, started=started
    )
    _report_tick(rt, progress, claim, view, transition)
    return result, follow


def _report_tick(
    rt: Runtime, progress: Progress, claim: runs.Claim, view: RunView, transition: Transition
) -> None:
    """Telemetry hears of a commit once what it allows is published (I1, I4)."""
    _observed(rt, progress, claim, transition)
    if rt.observer.enabled:
        safely(_report_calls, rt, progress, view, transition)


def _merged_follow(progress: Progress, step: Step) -> Follow | None:
    if step.local_calls:  # started in the commit (a fused commit, reads)
        return NextCalls(step.local_calls, step.claim.version + 1, step.predicted)
    if step.local_ids:
        return StartCalls(step.claim.turn, step.local_ids, step.claim.version + 1, step.predicted)
    return _follow(progress, step.claim, step.transition, ())


def _carried_follow(carried: Carried | None) -> Follow | None:
    if carried is None:
        return None
    return NextTick(carried.claim.phase, carried.claim.version, carried)


def _merged_end(
    progress: Progress,
    claim: runs.Claim,
    merged: list[Step],
    carried: Carried | None,
    point: str,
) -> None:
    """The fault points at the end of a merged transaction: before its COMMIT
    (``tick.merged.end``) and just after it (``tick.merged.after_commit``), named by the phase
    the transaction ended in (``phase``: call_model for its claim, await_tools after a
    dispatch) and the one it began with (``first``)."""
    if not merged and carried is None:
        return
    last = carried.claim.phase if carried is not None else merged[-1].transition.to
    faults.hit(
        point,
        phase=last.value if last is not None else "wait",
        task_id=claim.task_id,
        first=claim.phase.value,
        steps=len(merged) + (carried is not None),
    )


def _report_merged(
    rt: Runtime, progress: Progress, step: Step, follow: Follow | None, *, publish_next: bool
) -> None:
    """After the commit, what a merged step's own tick would have said: telemetry's tick, the
    calls it settled, its Celery task event (I21), its publishes, its log line."""
    claim, view, transition = step.claim, step.view, step.transition
    scope = TickScope(claim.execution_id, claim.phase, claim.version, rt.worker)
    name, args = f"charlie.phase.{claim.phase.value}", (claim.execution_id, claim.version)
    reporting = progress.reports.task(name, args) if progress.reports else nullcontext()
    with reporting as report, rt.observer.tick(scope):
        scope.result = _after_commit(
            rt,
            claim,
            view,
            transition,
            step.local_ids + tuple(c.call_id for c in step.local_calls),
            follow=follow,
            publish_next=publish_next,
            started=tuple(c.call_id for c in step.local_calls),
        )
        _report_tick(rt, Progress(scope=scope), claim, view, transition)
        if report is not None:
            report.result = scope.result


def _after_commit(
    rt: Runtime,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    local_calls: tuple[str, ...],
    *,
    follow: Follow | None = None,
    publish_next: bool | None = None,
    started: tuple[str, ...] = (),
) -> TickResult:
    """A committed step's publishes (after the commit, I1) and its log line. ``started``: the
    calls this commit started (told to watchers as started, I9)."""
    _publish(
        rt,
        claim,
        view,
        transition,
        publish_next=not isinstance(follow, NextTick) if publish_next is None else publish_next,
        local_calls=local_calls,
    )
    safely(streamed.committed, rt.events, view, claim.turn, transition, started)
    if transition.to is None:
        # Waiting (open tool calls, a stored wake-up): whoever settles the last call locks the
        # run after this commit and sees the wait (see store.calls.lock_run); the sweep wakes
        # the rest.
        return "waiting"
    log.info(
        "transition %s -> %s",
        claim.phase.value,
        transition.to.value,
        extra={**log_context(view), "to": transition.to.value, "note": transition.note},
    )
    if transition.to is Phase.DONE:
        rt.transcripts.forget(claim.execution_id)
        poke_waiters(rt, view.task.id)
        return "done"
    return "moved"
