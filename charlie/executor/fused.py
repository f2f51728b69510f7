"""Fused commits: a turn's merged transactions, each written in one statement.

A one-call turn on PostgreSQL commits twice:

- **A**, after the model call: call_model's result, the dispatch that queues its calls and, for
  a call this worker runs itself whose tool reads, that call's start (I9: committed before
  its handler runs). A write's or a wait's start commits on its own after A, so a worker that
  dies in between leaves it pending, free to start (I11), never an uncertain write.
- **B**, after the handler: the call's settle, await_tools, advance_turn and the next
  call_model's claim (committed before the model is called, I3, I5).

This module computes each step of such a transaction from what the worker knows, exactly as
the tick shell would after reading it (the same claim values, views, boundaries and phases:
steps.py), and hands their net effect to store.fused, which writes it in one statement if the
rows are as predicted (see there). Every step keeps its own claim, ``transitions`` row and
version (I1, I2, I21), and the named fault points fire where they fire in a merged transaction
(``tick.merged.step``, ``tick.in_transaction``, ``tick.merged.end`` before the statement,
``tick.merged.after_commit`` after it), so a kill at any of them recovers as it does there:
before the statement nothing was written. ``None`` from either function means not fused:
nothing was written, and the tick shell commits the steps the ordinary way.

B carries any call's result on into advance_turn and the next claim (steps.merges): the steps
after the settle are computed before the one statement, so a crash between the handler's end
and the commit costs what it costs before a settle of its own, no more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from charlie import faults
from charlie.domain import (
    JSON,
    CallState,
    CallView,
    Phase,
    RunView,
    Settlement,
    TaskStatus,
    TaskView,
    Transition,
    utcnow,
)
from charlie.executor.settle import CallResult
from charlie.executor.steps import (
    Carried,
    NeedsRead,
    Predicted,
    Progress,
    Step,
    Wrote,
    compute,
    decide_at_boundary,
    first_try,
    local_call_ids,
    merges,
    merges_next,
    open_settlement,
    starts_with_dispatch,
    view_of,
)
from charlie.observe import safely
from charlie.runtime import Runtime
from charlie.store import fused as store
from charlie.store import runs
from charlie.store.calls import ClaimedCall
from charlie.store.engine import again_if_disconnected, read, write_one

DIALECT = "postgresql"


@dataclass(frozen=True)
class Fused:
    """A fused commit that went through: its first step, as the tick shell reports it, and the
    steps merged after it."""

    claim: runs.Claim
    view: RunView
    transition: Transition
    merged: list[Step]
    carried: Carried | None
    wrote: list[Wrote]


def enabled(rt: Runtime) -> bool:
    settings = rt.settings
    return (
        settings.fuse_commits
        and settings.merge_phases
        and settings.inline_phases > 0
        and rt.engine.dialect.name == DIALECT
    )


def _task_write(*transitions: Transition) -> store.TaskWrite | None:
    """The task's row as the steps' own writes would leave it (runs._task_statement, applied
    in order): their usage summed, the last status set, started_at if any of them runs."""
    usage = [t.usage for t in transitions if t.usage]
    statuses = [t.task_status for t in transitions if t.task_status is not None]
    if not usage and not statuses:
        return None
    return store.TaskWrite(
        input_tokens=sum(int(u.get("input_tokens", 0) or 0) for u in usage),
        output_tokens=sum(int(u.get("output_tokens", 0) or 0) for u in usage),
        reasoning_tokens=sum(int(u.get("reasoning_tokens", 0) or 0) for u in usage),
        cache_read_tokens=sum(int(u.get("cache_read_tokens", 0) or 0) for u in usage),
        cache_write_tokens=sum(int(u.get("cache_write_tokens", 0) or 0) for u in usage),
        status=statuses[-1].value if statuses else None,
        running=any(s in (TaskStatus.RUNNING, TaskStatus.WAITING) for s in statuses),
    )


def _items(claim: runs.Claim, transition: Transition) -> list[tuple[int, str, str | None, object]]:
    return [
        (claim.next_seq + n, item.kind.value, item.call_id, item.payload)
        for n, item in enumerate(transition.items)
    ]


def _elapsed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _state_after(*transitions: Transition) -> JSON | None:
    states = [t.state for t in transitions if t.state is not None]
    return states[-1] if states else None


@dataclass(frozen=True)
class _Next:
    """A fused commit's step after its first, computed from what the worker knows as the tick
    shell would after reading it: its claim, view and transition, the turn's calls as the step
    before left them, its time, and when its step started (its record's duration)."""

    claim: runs.Claim
    view: RunView
    transition: Transition
    known: list[CallView]
    now: datetime
    started: float


@dataclass(frozen=True)
class _Awaited:
    """B's first step: the await tick with the local call's result applied to its view."""

    #: the turn's calls as predicted, before the result is applied (runs.calls_as_left's)
    loaded: RunView
    view: RunView
    settlement: Settlement
    transition: Transition


def model_turn(
    rt: Runtime,
    progress: Progress,
    claim: runs.Claim,
    view: RunView,
    transition: Transition,
    started: float,
) -> Fused | None:
    """A: call_model's result (``transition``, under ``claim``, carried by this worker) with
    the dispatch of its calls and, for the local call of a read, its start."""
    if not _fuses_model_turn(rt, progress, claim, transition):
        return None
    owner = rt.worker
    first_at = utcnow()
    first_ms = _elapsed_ms(started)
    dispatch = _next_step(rt, claim, transition, None, first_at, Phase.DISPATCH_TOOLS)
    if dispatch is None or not _only_awaits(dispatch.transition):
        return None
    local_ids = local_call_ids(rt, progress, dispatch.view, dispatch.transition)
    # Reads start here, in A; a write's or a wait's start commits on its own after A (I11).
    start_here = starts_with_dispatch(rt, dispatch.view, local_ids)
    rows = _dispatched_rows(rt, claim, transition, first_at, dispatch, local_ids, start_here)
    task = claim.task
    assert task is not None
    commit = _model_turn_commit(owner, claim, task, transition, first_at, first_ms, dispatch, rows)
    faults.hit(
        "tick.merged.end",
        phase=Phase.AWAIT_TOOLS.value,
        task_id=claim.task_id,
        first=claim.phase.value,
        steps=1,
    )
    fresh = _commit(rt, commit)
    _observed(rt, "model_turn", fresh is not None)
    if fresh is None:
        return None
    step = _dispatched_step(owner, claim, task, dispatch, rows, local_ids, start_here)
    wrote: list[Wrote] = [
        (claim.next_seq, runs.written_items(DIALECT, claim, transition)),
        (dispatch.claim.next_seq, []),
    ]
    progress.merged = 1
    return Fused(claim, view, transition, [step], None, wrote)


def _fuses_model_turn(
    rt: Runtime, progress: Progress, claim: runs.Claim, transition: Transition
) -> bool:
    """Whether A may be tried: a model's call of tools, whose dispatch merges after it."""
    return (
        enabled(rt)
        and claim.phase is Phase.CALL_MODEL
        and transition.to is Phase.DISPATCH_TOOLS
        and merges(rt, claim, progress)
        and merges_next(claim, transition)
    )


def _next_step(
    rt: Runtime,
    claim: runs.Claim,
    transition: Transition,
    calls_before: list[CallView] | None,
    at: datetime,
    phase: Phase,
) -> _Next | None:
    """The step after ``claim``'s (``phase``), from the transition that moved there (committed
    at ``at``) instead of the rows; None when it cannot be computed so, or its boundary decides
    (the ordinary path does those)."""
    faults.hit(
        "tick.merged.step",
        phase=phase.value,
        task_id=claim.task_id,
        first=claim.phase.value,
    )
    started = time.perf_counter()
    next_claim = runs.claimed_next(claim, transition)
    known = runs.calls_as_left(
        claim, calls_before, transition, now=at, owner=rt.worker, dialect=DIALECT
    )
    if known is None:
        return None
    now = utcnow()
    try:
        view = view_of(rt, None, next_claim, now, known)
    except NeedsRead:
        return None  # (a stop with mail waiting, say: the ordinary path reads it, I22)
    if decide_at_boundary(rt, view) is not None:
        return None  # a stop, a poison: the ordinary path says what happens
    computed = compute(rt, view)
    faults.hit(
        "tick.in_transaction",
        phase=phase.value,
        task_id=claim.task_id,
        messages=len(computed.take_messages),
    )
    return _Next(next_claim, view, computed, known, now, started)


def _only_awaits(dispatched: Transition) -> bool:
    """A dispatch A writes: its calls queued (or asked) and the move to await_tools, nothing
    to publish, wake or write besides."""
    return (
        dispatched.to is Phase.AWAIT_TOOLS
        and not dispatched.publish_next
        and dispatched.wake_at is None
        and not (dispatched.items or dispatched.calls or dispatched.settle)
        and not (dispatched.take_messages or dispatched.finish_order or dispatched.next_turn)
    )


def _dispatched_rows(
    rt: Runtime,
    claim: runs.Claim,
    transition: Transition,
    first_at: datetime,
    dispatch: _Next,
    local_ids: tuple[str, ...],
    start_here: bool,
) -> list[dict[str, Any]]:
    """The model's new calls' rows as A inserts them: queued by the dispatch and, the local
    reads, started (I9)."""
    owner, now = rt.worker, dispatch.now
    implementations = dict(rt.tools.implementations())
    lease_until = now + timedelta(seconds=rt.settings.lease_seconds)
    queued = dict(dispatch.transition.queue_calls + dispatch.transition.ask_calls)
    rows = []
    for row in runs.call_rows(claim, transition, first_at):
        deadline = queued.get(row["call_id"])
        if deadline is not None:  # as runs._QUEUE_CALLS
            row.update(queued_at=now, dispatch_version=dispatch.claim.version, deadline_at=deadline)
        if start_here and row["call_id"] in local_ids:  # as calls.claim_call, mode start
            row.update(
                state=CallState.STARTED.value,
                started_at=now,
                started_by=owner,
                lease_owner=owner,
                lease_until=lease_until,
                attempts=1,
                implementation=implementations.get(row["name"]),
            )
        rows.append(row)
    return rows


def _model_turn_commit(
    owner: str,
    claim: runs.Claim,
    task: TaskView,
    transition: Transition,
    first_at: datetime,
    first_ms: float,
    dispatch: _Next,
    rows: list[dict[str, Any]],
) -> store.FusedCommit:
    """A's net effect: call_model's move and the dispatch's, each with its own record."""
    claim2, dispatched, now = dispatch.claim, dispatch.transition, dispatch.now
    return store.FusedCommit(
        run=store.RunBefore(claim.execution_id, claim.task_id, claim.phase, claim.version, owner),
        after=store.RunAfter(
            phase=Phase.AWAIT_TOOLS,
            steps=2,
            turns=0,
            items=len(transition.items),
            state=_state_after(transition, dispatched),
            model_calls=transition.model_calls,
            model_repeats=transition.model_repeats,
            lease_until=None,
        ),
        owner=owner,
        now=now,
        records=[
            store.Record(
                claim.phase,
                Phase.DISPATCH_TOOLS,
                claim.version + 1,
                first_at,
                first_ms,
                transition.note,
            ),
            store.Record(
                Phase.DISPATCH_TOOLS,
                Phase.AWAIT_TOOLS,
                claim2.version + 1,
                now,
                _elapsed_ms(dispatch.started),
                dispatched.note,
            ),
        ],
        turn=claim.turn,
        task_status=task.status.value,
        task_timeout_at=task.timeout_at,
        task_write=_task_write(transition, dispatched),
        items=_items(claim, transition),
        calls=rows,
    )


def _dispatched_step(
    owner: str,
    claim: runs.Claim,
    task: TaskView,
    dispatch: _Next,
    rows: list[dict[str, Any]],
    local_ids: tuple[str, ...],
    start_here: bool,
) -> Step:
    """The dispatch as A committed it, for what follows the commit: the local calls it
    started (or left to start apart), and what B may assume of them."""
    claim2, view2, dispatched, now = (
        dispatch.claim,
        dispatch.view,
        dispatch.transition,
        dispatch.now,
    )
    # What the turn's next commit (B, after the local call) may assume.
    left = runs.calls_as_left(
        claim2, view2.calls, dispatched, now=now, owner=owner, dialect=DIALECT
    )
    run_here: tuple[ClaimedCall, ...] = ()
    predicted = None
    if local_ids and left is not None:
        predicted = Predicted(runs.claimed_next(claim2, dispatched), left)
    if start_here:
        views = {c.call_id: c for c in (left or dispatch.known)}
        run_here = _started_here(claim, task, rows, views, local_ids, now, owner)
        if predicted is not None:
            predicted = predicted.started(run_here, owner)
    return Step(claim2, view2, dispatched, () if start_here else local_ids, run_here, predicted)


def _started_here(
    claim: runs.Claim,
    task: TaskView,
    rows: list[dict[str, Any]],
    views: dict[str, CallView],
    local_ids: tuple[str, ...],
    now: datetime,
    owner: str,
) -> tuple[ClaimedCall, ...]:
    """The local calls A started, as calls.claim_call would have returned them."""
    by_id = {r["call_id"]: r for r in rows}
    return tuple(
        ClaimedCall(
            execution_id=claim.execution_id,
            turn=claim.turn,
            call_id=call_id,
            name=views[call_id].name,
            arguments=views[call_id].arguments,
            resumable=bool(by_id[call_id]["resumable"]),
            started_at=now,
            started_by=owner,
            handle=None,
            attempts=1,
            deadline_at=by_id[call_id]["deadline_at"],
            task_metadata=task.metadata,
            implementation=by_id[call_id]["implementation"],
            on_interrupt=by_id[call_id]["on_interrupt"],
        )
        for call_id in local_ids
    )


def settle_turn(rt: Runtime, progress: Progress, started: float) -> Fused | None:
    """B: the local call's result (``progress.settlement``) settled in the await tick that
    ``progress.predicted`` foresees, with advance_turn and, inline, the next call_model's
    claim."""
    predicted, done = progress.predicted, progress.settlement
    if predicted is None or done is None or not enabled(rt):
        return None
    claim = predicted.claim
    if not (
        claim.phase is Phase.AWAIT_TOOLS
        and claim.inbox == 0  # mail: advance_turn reads the mailbox (the ordinary way)
        and first_try(rt, claim, progress)
    ):
        return None
    task = claim.task
    assert task is not None
    now = utcnow()
    awaited = _await_step(rt, claim, predicted, done, now)
    if awaited is None:
        return None
    first_ms = _elapsed_ms(started)
    advance = _next_step(
        rt, claim, awaited.transition, awaited.loaded.calls, now, Phase.ADVANCE_TURN
    )
    if advance is None or not _only_calls_the_model(advance.transition):
        return None
    claims_model = progress.inline  # else call_model's tick is published after the commit
    if claims_model:
        faults.hit(
            "tick.merged.step",
            phase=Phase.CALL_MODEL.value,
            task_id=claim.task_id,
            first=claim.phase.value,
        )
    record_ms = _elapsed_ms(advance.started)
    commit = _settle_turn_commit(
        rt, claim, task, now, awaited, advance, done,
        first_ms=first_ms, record_ms=record_ms, claims_model=claims_model,
        turn_calls=len(predicted.calls),
    )  # fmt: skip
    faults.hit(
        "tick.merged.end",
        phase=Phase.CALL_MODEL.value,
        task_id=claim.task_id,
        first=claim.phase.value,
        steps=1 + claims_model,
    )
    fresh = _commit(rt, commit)
    _observed(rt, "settle_turn", fresh is not None)
    if fresh is None:
        return None
    progress.merged = 1 + claims_model
    claim2, advanced = advance.claim, advance.transition
    wrote: list[Wrote] = [
        (claim.next_seq, []),
        (claim2.next_seq, runs.written_items(DIALECT, claim2, advanced)),
    ]
    carried = _carried_model_claim(rt, claim2, advanced, fresh, wrote) if claims_model else None
    step = Step(claim2, advance.view, advanced)
    return Fused(claim, awaited.view, awaited.transition, [step], carried, wrote)


def _await_step(
    rt: Runtime, claim: runs.Claim, predicted: Predicted, done: CallResult, now: datetime
) -> _Awaited | None:
    """The await tick B begins with, from the run as predicted: the local call's result
    settled in its view; None when that cannot be computed so, or is not a plain settle."""
    try:
        loaded = view_of(rt, None, claim, now, predicted.calls)
    except NeedsRead:
        return None
    view, settlement = open_settlement(rt, loaded, done)
    if settlement is None or decide_at_boundary(rt, view) is not None:
        return None
    awaited = compute(rt, view)
    faults.hit(
        "tick.in_transaction",
        phase=Phase.AWAIT_TOOLS.value,
        task_id=claim.task_id,
        messages=len(awaited.take_messages),
    )
    awaited.settle.append(settlement)
    if not (
        awaited.to is Phase.ADVANCE_TURN
        and len(awaited.settle) == 1
        and awaited.wake_at is None
        and not (awaited.items or awaited.calls or awaited.queue_calls or awaited.ask_calls)
        and not (awaited.take_messages or awaited.finish_order or awaited.next_turn)
    ):
        return None
    return _Awaited(loaded, view, settlement, awaited)


def _only_calls_the_model(advanced: Transition) -> bool:
    """An advance_turn B writes: the move to call_model (published, or claimed by B), with
    no call to queue, settle or wake for, and no mail to take."""
    return (
        advanced.to is Phase.CALL_MODEL
        and advanced.publish_next
        and advanced.wake_at is None
        and not (advanced.calls or advanced.queue_calls or advanced.ask_calls)
        and not (advanced.settle or advanced.take_messages)
    )


def _settle_turn_commit(
    rt: Runtime,
    claim: runs.Claim,
    task: TaskView,
    now: datetime,
    awaited: _Awaited,
    advance: _Next,
    done: CallResult,
    *,
    first_ms: float,
    record_ms: float,
    claims_model: bool,
    turn_calls: int,
) -> store.FusedCommit:
    """B's net effect: the await tick's claim, settle and move, advance_turn's move and, with
    ``claims_model``, call_model's claim, each step with its own record."""
    settlement, claim2, advanced = awaited.settlement, advance.claim, advance.transition
    awaits, now2 = awaited.transition, advance.now
    return store.FusedCommit(
        run=_row_before_claim(claim),
        after=store.RunAfter(
            phase=Phase.CALL_MODEL,
            steps=2,
            turns=1 if advanced.next_turn else 0,
            items=len(advanced.items),
            state=_state_after(awaits, advanced),
            model_calls=0,
            model_repeats=0,
            lease_until=now2 + timedelta(seconds=rt.settings.lease_seconds)
            if claims_model
            else None,
        ),
        owner=rt.worker,
        now=now2,
        records=[
            store.Record(
                claim.phase, Phase.ADVANCE_TURN, claim.version + 1, now, first_ms, awaits.note
            ),
            store.Record(
                Phase.ADVANCE_TURN,
                Phase.CALL_MODEL,
                claim2.version + 1,
                now2,
                record_ms,
                advanced.note,
            ),
        ],
        turn=claim.turn,
        task_status=task.status.value,
        task_timeout_at=task.timeout_at,
        task_write=_task_write(awaits, advanced),
        items=_items(claim2, advanced),
        settles=[_local_settle(settlement, advanced, done, now)],
        orders=[(c, n) for c, n in advanced.finish_order.items() if c != settlement.call_id],
        turn_calls=turn_calls,
    )


def _row_before_claim(claim: runs.Claim) -> store.RunBefore:
    """The run's row as B expects to find it: B takes the await tick's claim itself, so the
    row is as the claim (predicted, steps.Predicted) found it, not as it left it."""
    return store.RunBefore(
        claim.execution_id,
        claim.task_id,
        claim.phase,
        claim.version,
        None,
        attempts=claim.attempts - 1,  # the row's, before this commit's claim counts one
        inbox=claim.inbox,
        turn=claim.turn,
        next_seq=claim.next_seq,
        state=claim.state,
    )


def _local_settle(
    settlement: Settlement, advanced: Transition, done: CallResult, now: datetime
) -> store.Settle:
    """The local call's settle, held to the attempt that started it (I12)."""
    return store.Settle(
        settlement.call_id,
        settlement.outcome.value,
        settlement.result,
        settlement.duration_ms,
        advanced.finish_order.get(settlement.call_id),
        done.call.attempts,
        now,  # await_tools settles it (runs.calls_as_left's settled_at)
    )


def _carried_model_claim(
    rt: Runtime,
    claim2: runs.Claim,
    advanced: Transition,
    fresh: runs.Fresh,
    wrote: list[Wrote],
) -> Carried:
    """call_model's claim, B's last write, for this worker to call the model from."""
    started3 = time.perf_counter()
    claim3 = runs.claimed_next(claim2, advanced, fresh)
    return Carried(claim3, _model_view(rt, claim3, wrote), started3)


def _commit(rt: Runtime, commit: store.FusedCommit) -> runs.Fresh | None:
    """Write ``commit`` in one statement; an outcome left unknown (a connection lost while the
    server may have committed) is read back, never assumed: taken as nothing written, the
    ordinary path would find its own steps gone, a settled call's result a late report and the
    next model call's claim, this worker's, orphaned until its lease lapsed."""
    try:
        with write_one(rt.engine) as conn:
            return store.commit_fused(conn, commit)
    except store.OutcomeUnknown:

        def read_back() -> runs.Fresh | None:
            with write_one(rt.engine) as conn:
                return store.fused_outcome(conn, commit)

        return again_if_disconnected(read_back, "read back a fused commit")


def _observed(rt: Runtime, commit: str, applied: bool) -> None:
    if rt.observer.enabled:
        safely(rt.observer.fused_commit, commit, applied)


def _model_view(rt: Runtime, claim: runs.Claim, wrote: list[Wrote]) -> RunView:
    """The carried call_model claim's view: its transcript from what this process knows, or,
    when that is not all of it, read (after the commit: the transcript as committed, I6)."""
    now = utcnow()
    try:
        return view_of(rt, None, claim, now, None, wrote)
    except NeedsRead:
        with read(rt.engine) as conn:
            return view_of(rt, conn, claim, now, None, wrote)
