"""A step's pieces, shared by the tick shell (tick.py) and its fused commits (fused.py).

A step is one phase transition: its claim, the view its phase sees (read from the database,
or known from what this worker's own transaction left), the boundary checks, the phase itself,
and what this worker does after it. Nothing here commits; the callers do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from charlie import pricing
from charlie.domain import (
    CallState,
    CallView,
    Effect,
    Item,
    OnInterrupt,
    Outcome,
    Phase,
    RunView,
    Settlement,
    Transition,
)
from charlie.executor import boundary
from charlie.executor.phases import needs, run_phase
from charlie.executor.settle import CallResult
from charlie.observe import TickScope
from charlie.runtime import Runtime
from charlie.store import runs, spend
from charlie.store.calls import ClaimedCall
from charlie.store.transcripts import as_stored
from charlie.store.types import Connection

if TYPE_CHECKING:
    from charlie.executor.events import InlineReports

log = logging.getLogger("charlie.tick")

#: Phases a merged transaction runs whole (claim, phase, commit): nothing outside the database
#: happens between their claim and their commit. Of the slow phases only call_model's claim is
#: taken in a merged transaction, and the transaction ends with it.
MERGEABLE = frozenset(
    {Phase.LOAD_CONTEXT, Phase.DISPATCH_TOOLS, Phase.AWAIT_TOOLS, Phase.ADVANCE_TURN}
)
#: at most this many steps merged into one transaction
MAX_MERGED = 4


@dataclass(frozen=True)
class Carried:
    """A slow phase's claim, committed at the end of a merged transaction (its attempt counted,
    its lease this worker's): its tick works from here without claiming again."""

    claim: runs.Claim
    view: RunView
    started: float


@dataclass(frozen=True)
class Predicted:
    """The run as this worker's last commit left it, for the commit after the turn's local call
    (a fused settle, fused.settle_turn): the await_tools claim that commit takes, as the claim
    statement would return it, and the turn's calls as they stand once the call started. What
    it predicts is checked in the fused statement; whatever else happened meanwhile (a settle
    by a sweep, a cancel, a message) fails the check, and the ordinary path reads the rows."""

    claim: runs.Claim
    calls: list[CallView]

    def started(self, started: Sequence[ClaimedCall], owner: str) -> Predicted:
        """The calls once this worker's start of each of ``started`` committed
        (calls.claim_call)."""
        by_id = {c.call_id: c for c in started}
        return replace(
            self,
            calls=[
                replace(
                    c,
                    state=CallState.STARTED,
                    started_at=by_id[c.call_id].started_at,
                    lease_owner=owner,
                    attempts=by_id[c.call_id].attempts,
                )
                if c.call_id in by_id
                else c
                for c in self.calls
            ],
        )

    def settled(self, done: CallResult, owner: str, at: datetime) -> Predicted | None:
        """The calls once this worker's settle of ``done`` committed, at ``at`` (store.fused.
        settle_held, as calls.SETTLE writes it); None when its result's stored form cannot be
        predicted (transcripts.as_stored)."""
        ok, result = as_stored(done.result, "postgresql")
        if not ok:
            return None
        call_id = done.call.call_id
        return replace(
            self,
            calls=[
                replace(
                    c,
                    state=CallState.SETTLED,
                    outcome=done.outcome,
                    result=result,
                    settled_at=at,
                    settled_by=owner,
                    lease_owner=None,
                    hold=None,
                )
                if c.call_id == call_id
                else c
                for c in self.calls
            ],
        )


@dataclass(frozen=True)
class NextTick:
    """The run's next phase, to run in this worker."""

    phase: Phase
    version: int
    #: its claim, already committed by this worker (a merged transaction's last step)
    carried: Carried | None = None


@dataclass(frozen=True)
class Step:
    """One phase transition committed in a merged transaction, for what follows the commit."""

    claim: runs.Claim
    view: RunView
    transition: Transition
    #: the turn's calls this worker runs itself (local_call_ids), queued in this transaction:
    #: to start in a commit of their own and run here (StartCalls)
    local_ids: tuple[str, ...] = ()
    #: ...or already started in this transaction (a fused commit: reads), to run here
    local_calls: tuple[ClaimedCall, ...] = ()
    #: what the commit after the local calls may assume (fused commits)
    predicted: Predicted | None = None


@dataclass(frozen=True)
class NextCalls:
    """The turn's calls, marked started, to run in this worker (a "local activity": one, or
    several at once, a thread each); then the await tick at ``await_version``."""

    calls: tuple[ClaimedCall, ...]
    await_version: int
    predicted: Predicted | None = None


@dataclass(frozen=True)
class StartCalls:
    """The turn's calls this worker runs itself, queued by a dispatch merged into another
    step's transaction: this worker marks them started in a commit of their own (I9), then
    runs them as NextCalls. Their start is not carried in that transaction, so a worker that
    dies after the commit leaves them pending, and the sweep starts them normally (I11), not
    uncertain ones (I10)."""

    turn: int
    call_ids: tuple[str, ...]
    await_version: int
    predicted: Predicted | None = None


Follow = NextTick | NextCalls | StartCalls

#: a step committed in this transaction: its claim's next_seq and the items it wrote, as the
#: table returns them (None: not predicted, see runs.written_items)
Wrote = tuple[int, list[Item] | None]


@dataclass
class Progress:
    """What one tick knows of the chain it runs in, and tells it back."""

    #: the claim's transaction committed (the slow path), so the attempt was already counted.
    claim_committed: bool = False
    #: the next phase may run in this worker instead of being published.
    inline: bool = False
    #: commit the claim (and its attempt count) before running even a fast phase.
    durable_claim: bool = False
    #: a call's result to settle in this tick's transaction (the turn's local call).
    settlement: CallResult | None = None
    #: set once that transaction committed: True if it settled the call, False if the call
    #: had been settled already (a late report). None: not committed here.
    settled: bool | None = None
    #: what telemetry hears of this tick (charlie.observe)
    scope: TickScope | None = None
    #: this tick's claim, committed already at the end of a merged transaction
    carried: Carried | None = None
    #: where the Celery task events of steps merged into this tick's transaction go (I21)
    reports: InlineReports | None = None
    #: how many following steps this tick merged into its transaction
    merged: int = 0
    #: the run as this worker's last commit left it (fused commits, see Predicted)
    predicted: Predicted | None = None


class NeedsRead(Exception):
    """A view needs a read that the caller, holding no connection, cannot make."""


def view_of(
    rt: Runtime,
    conn: Connection | None,
    claim: runs.Claim,
    now: datetime,
    known_calls: list[CallView] | None = None,
    wrote: Sequence[Wrote] = (),
) -> RunView:
    """The view ``claim``'s phase sees. ``known_calls``: the turn's calls as this transaction
    holds them (runs.calls_as_left), read instead of loaded. ``wrote``: the items this
    transaction wrote before this step. Without ``conn``, raises NeedsRead when it would have
    to read."""
    task = claim.task
    assert task is not None  # a claim comes with its task
    if (
        claim.phase is Phase.CALL_MODEL
        and task.budget
        and task.tree is None
        and (task.parent_id is not None or task.delegated)
    ):
        # A budget in a delegation tree counts the tree's spend: its own subtree's, and its
        # ancestors' budgets theirs (store.spend). Tasks outside a tree read nothing more.
        if conn is None:
            raise NeedsRead("the delegation tree's spend")
        task = replace(task, tree=spend.delegation_spend(conn, task.id))
    wanted = needs(claim.phase) | ({"calls"} if claim.phase in boundary.TOOL_PHASES else set())
    if "calls" in wanted and known_calls is None:
        if conn is None:
            raise NeedsRead("the turn's calls")
        # Locked in tool phases: a settle racing this tick waits, then finds the call settled
        # and becomes a late report, so the transcript and the record agree (I8, I12).
        known_calls = runs.load_calls(conn, claim.execution_id, claim.turn, lock=True)
    messages = []
    # The mailbox is read only when the claim says it holds mail: no statement otherwise. A
    # boundary that stops the run takes it in too (boundary.stop, I22).
    if claim.inbox > 0 and (
        "messages" in wanted
        or (
            claim.phase in boundary.MAIL_AT_STOP
            and boundary.stop_reason_of(claim.phase, task, now) is not None
        )
    ):
        if conn is None:
            raise NeedsRead("the mailbox")
        messages = runs.load_messages(conn, claim.task_id)
    items, compaction_known = (
        transcript_of(rt, conn, claim, wrote) if "items" in wanted else ([], None)
    )
    return RunView(
        execution_id=claim.execution_id,
        phase=claim.phase,
        version=claim.version,
        turn=claim.turn,
        state=claim.state,
        attempts=claim.attempts,
        task=task,
        now=now,
        items=items,
        calls=known_calls if "calls" in wanted and known_calls is not None else [],
        last_error=claim.last_error,
        messages=messages,
        compaction_known=compaction_known,
    )


def transcript_of(
    rt: Runtime, conn: Connection | None, claim: runs.Claim, wrote: Sequence[Wrote]
) -> tuple[list[Item], tuple[int, int] | None]:
    """The run's transcript for the model: the committed prefix this process remembers, the
    items this transaction wrote, and a read of only what else has committed since; no read
    at all when the claim's next_seq says there is nothing else. With it, what the remembered
    prefix says of its compactions (RunView.compaction_known)."""
    remembered, newest = rt.transcripts.remembered(claim.execution_id, claim.identity)
    known = list(remembered)
    if len(known) > claim.next_seq:
        known = []  # (cannot happen: a remembered prefix has committed) read it all
    cursor = len(known)
    compaction_known = (cursor, newest) if known else None
    pending: list[Item] = []
    for next_seq, items in wrote:
        if items is None or next_seq != cursor + len(pending):
            break
        pending.extend(items)
    else:
        if cursor + len(pending) == claim.next_seq:
            return [*known, *pending], compaction_known
    if conn is None:
        raise NeedsRead("the transcript")
    return runs.load_items(conn, claim.execution_id, known), compaction_known


def remember_transcript(
    rt: Runtime,
    claim: runs.Claim,
    first: list[Item] | None,
    wrote: Sequence[Wrote],
    carried: Carried | None,
) -> None:
    """After the COMMIT of a transaction (never before: a rolled-back item must not be
    remembered), what this process now knows of the run's committed transcript: a carried
    call_model view's items, or the first step's view's items (or the remembered prefix) and
    the items each step wrote after them."""
    execution_id, identity = claim.execution_id, claim.identity
    if carried is not None and carried.view.phase is Phase.CALL_MODEL:
        rt.transcripts.put(execution_id, carried.claim.identity, carried.view.items)
        return
    items = list(first) if first is not None else list(rt.transcripts.get(execution_id, identity))
    for next_seq, written in wrote:
        if written is None or next_seq != len(items):
            break
        items.extend(written)
    rt.transcripts.put(execution_id, identity, items)


def decide_at_boundary(rt: Runtime, view: RunView) -> Transition | None:
    """What the tick does instead of the phase, if anything."""
    if view.attempts > rt.settings.max_attempts:
        return boundary.poison(view, rt.settings.max_attempts)
    reason = boundary.stop_reason(view)
    if reason is not None:
        return boundary.stop(view, reason)
    if view.task.budget:  # only call_model's claim loads one
        prices: pricing.PriceTable = {}
        budgets = [view.task.budget, *(t.budget or {} for t in view.task.tree or ())]
        if any("usd" in b for b in budgets):  # only a cost limit needs the table
            try:
                prices = pricing.price_table(rt.settings.prices)
            except pricing.PriceError as exc:
                return boundary.fail(view, exc)
        over = boundary.over_budget(view, prices)
        if over is not None:
            return over
    return boundary.take_mail(view)


def compute(rt: Runtime, view: RunView) -> Transition:
    try:
        return run_phase(view, rt.deps)
    except Exception as exc:
        if view.phase is Phase.REPORT_FAILURE:
            # Reporting a failure failed: come back later rather than fail the failure.
            log.exception("report_failure raised", extra=log_context(view))
            retries = int(view.state.get("report_failure_retries", 0)) + 1
            return Transition(
                to=None,
                state={**view.state, "report_failure_retries": retries},
                wake_at=view.now + timedelta(seconds=min(60, 2**retries)),
                publish_next=False,
                note=f"report_failure raised {type(exc).__name__}",
            )
        log.exception("phase raised; moving to report_failure", extra=log_context(view))
        return boundary.fail(view, exc)


def log_context(view: RunView) -> dict[str, object]:
    return {
        "execution_id": view.execution_id,
        "task_id": view.task.id,
        "phase": view.phase.value,
        "version": view.version,
    }


def local_call_ids(
    rt: Runtime, progress: Progress, view: RunView, transition: Transition
) -> tuple[str, ...]:
    """The calls this worker runs itself rather than hand each to another through the broker:
    a dispatch that queued every open call of the turn, one of any tool, or up to
    CHARLIE_LOCAL_CALLS of ``threadsafe`` tools (run at once, a thread each). A larger
    fan-out, one with calls waiting for a person, or one a tool of which is not threadsafe is
    published, call by call (I14: each dispatch still queues at most a batch)."""
    queued = [call_id for call_id, _deadline in transition.queue_calls]
    if not (progress.inline and transition.to is Phase.AWAIT_TOOLS and queued):
        return ()
    if transition.ask_calls or any(
        c.state is not CallState.SETTLED and c.call_id not in queued for c in view.calls
    ):
        return ()
    if len(queued) == 1:
        return tuple(queued)
    if len(queued) > rt.settings.local_calls:
        return ()
    names = {c.call_id: c.name for c in view.calls}
    for call_id in queued:
        definition = rt.tools.get(names.get(call_id, ""))
        if definition is None or not definition.threadsafe:
            return ()
    return tuple(queued)


def starts_with_dispatch(rt: Runtime, view: RunView, local_ids: Sequence[str]) -> bool:
    """Whether the turn's local calls are started in the commit that dispatches them (I9)
    rather than in a commit of their own after it: only when every one reads, and is not held
    for an operator when interrupted. A crash right after that commit leaves them started, for
    the sweep to settle interrupted (I10); a write's or a wait's start commits on its own, so
    the same crash leaves it pending, free to start (I11), never an uncertain write; and so
    does a read held when interrupted, which must not wait for a verdict on a call that never
    ran."""
    names = {c.call_id: c.name for c in view.calls}
    definitions = [rt.tools.get(names.get(call_id, "")) for call_id in local_ids]
    return bool(local_ids) and all(
        d is not None and d.effect is Effect.READ and d.on_interrupt is OnInterrupt.REPORT
        for d in definitions
    )


def open_settlement(
    rt: Runtime, view: RunView, done: CallResult
) -> tuple[RunView, Settlement | None]:
    """Apply a call's result to the view the phase sees, if the call is still open and still
    held under the lease this worker started it with (I12, I13); else the
    view unchanged and None: the result is a late report."""
    call = done.call
    open_call = next(
        (
            c
            for c in view.calls
            if c.call_id == call.call_id
            and c.state is not CallState.SETTLED
            and c.lease_owner == rt.worker
            and c.attempts == call.attempts
        ),
        None,
    )
    if open_call is None:
        return view, None
    settled = replace(
        open_call,
        state=CallState.SETTLED,
        outcome=done.outcome,
        result=done.result,
        settled_at=view.now,
    )
    view = replace(view, calls=[settled if c is open_call else c for c in view.calls])
    return view, Settlement(call.call_id, done.outcome, done.result, done.duration_ms)


def merges(rt: Runtime, claim: runs.Claim, progress: Progress, local: bool = False) -> bool:
    """Whether the steps after this one may share its transaction (see tick._merge).

    Not a retry: a claim committed apart (a redelivered or re-published tick) or a second
    attempt commits on its own, so a step that kills its worker is counted in its own phase.
    A call's result rides on with the steps after its settle whatever its effect: they are
    computed in the same transaction within milliseconds (in one statement on PostgreSQL,
    before it is sent), so a crash that costs the result there is a crash between the handler's
    end and the commit, which a settle of its own cannot close either (the call then settles
    interrupted, or is reconciled, I10; it is never run again)."""
    return first_try(rt, claim, progress, local)


def first_try(rt: Runtime, claim: runs.Claim, progress: Progress, local: bool = False) -> bool:
    """Merging is on and this is the step's first try (see merges)."""
    return (
        rt.settings.merge_phases
        and rt.settings.inline_phases > 0
        and claim.attempts == 1
        and not progress.durable_claim
        and not local
    )


def merges_next(claim: runs.Claim, transition: Transition) -> bool:
    """Whether a merged transaction runs the step after this transition whole (claim, phase,
    commit), so this transition's compare-and-set takes that step's claim too."""
    to = transition.to
    return (
        to is not None
        and transition.publish_next
        and transition.wake_at is None
        # nothing to publish first: no invocations, no cancel of outside work (I1)
        and not transition.queue_calls
        and not any(s.outcome is Outcome.CANCELED for s in transition.settle)
        and to in MERGEABLE
        # (a dispatch's next batch is a tick of its own, its invocations published first)
        and to is not claim.phase
    )
