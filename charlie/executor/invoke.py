"""Invoking one tool call: mark started (I9) → run the handler → settle, first result wins (I12).

Engine work, not the tool SDK's: the SDK says how a handler is called (tools/calling.py); this
claims the call, builds its ToolContext with the engine's ports, runs it under a lease and
hands the result to :mod:`charlie.executor.settle`.

The handler runs outside any transaction while a heartbeat renews the call's lease (I5). A
worker killed mid-handler leaves the call started with a lapsing lease; the sweep then settles
it ``interrupted`` (I10), or re-dispatches it here in ``resume`` mode if the tool is a
resumable wait, or in ``reconcile`` mode if the tool can find out what happened. A wait
settled past its deadline is observed again in ``observe`` mode, for its late report (I13).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path

from charlie import faults
from charlie.config import WorkspaceRefused
from charlie.domain import JSON, CallState, Outcome, task_id_of, utcnow
from charlie.executor import streamed
from charlie.executor.children import DbChildren, DbRecord
from charlie.executor.settle import CallResult, log_settled, settle_in_turn, settle_result
from charlie.leases import Held
from charlie.observe import safely
from charlie.runtime import Runtime
from charlie.store import calls
from charlie.store.calls import ClaimedCall, Mode
from charlie.store.engine import again_if_disconnected, read, write, write_one
from charlie.store.types import Connection
from charlie.tools.calling import LookFailed, cap_result, run_handler, run_reconcile
from charlie.tools.context import AskPerson, LeaseLost, Pending, ToolContext
from charlie.tools.registry import ToolUnavailable

log = logging.getLogger("charlie.tool")


def workspace_for(rt: Runtime, task_id: str, metadata: JSON) -> Path:
    """The call's workspace: ``metadata["workspace"]`` confined to the workspace roots, or the
    task's own directory under CHARLIE_HOME. A refused one is never created: the task's own
    directory stands in, and :func:`workspace_refusal` keeps every tool from running."""
    configured = metadata.get("workspace")
    path = rt.settings.workspaces_dir / task_id
    if configured is not None and workspace_refusal(rt, metadata) is None:
        path = rt.settings.confine_workspace(configured)
    path.mkdir(parents=True, exist_ok=True)
    return path


def workspace_refusal(rt: Runtime, metadata: JSON) -> str | None:
    """Why no tool may run for this task: its workspace lies outside the allowed roots (a task
    saved before the roots were set, or not through submit). Checked again here, since the
    workers' roots are what guard their disk; None when it is allowed."""
    configured = metadata.get("workspace")
    if configured is None:
        return None
    try:
        rt.settings.confine_workspace(configured)
    except WorkspaceRefused as exc:
        return str(exc)
    return None


def _call_heartbeat(rt: Runtime, call: ClaimedCall) -> AbstractContextManager[Held]:
    """Renew the call's lease while its handler runs (I5); the Held says when it was lost."""

    def renew(conn: Connection) -> bool:
        until = utcnow() + timedelta(seconds=rt.settings.lease_seconds)
        return calls.renew_call_lease(conn, call, rt.worker, until)

    seconds = rt.settings.lease_seconds
    return rt.leases.held(renew, seconds / 3, f"call-{call.call_id}", lease_seconds=seconds)


def _evidence(call: ClaimedCall) -> JSON:
    return {
        "started_at": call.started_at.isoformat() if call.started_at else None,
        "started_by": call.started_by,
        "attempts": call.attempts,
        "handle": call.handle,
        "implementation": call.implementation,
    }


def run_call(
    rt: Runtime, execution_id: str, turn: int, call_id: str, mode: Mode
) -> tuple[str, int | None]:
    """Claim, run and settle one call. Also returns the version of the run's await tick when
    this call completed the turn of a run that waits in await_tools (whoever settles the last
    call runs or publishes that tick, I7), else None."""
    if mode == "observe":
        return observe_overdue_wait(rt, execution_id, turn, call_id), None
    if mode == "cancel":
        return cancel_outside_work(rt, execution_id, turn, call_id), None

    def claim() -> ClaimedCall | None:
        return calls.claim_call_alone(
            rt.engine,
            execution_id,
            turn,
            call_id,
            mode,
            rt.worker,
            rt.settings.lease_seconds,
            implementations=rt.tools.implementations(),
            fused=rt.settings.fuse_commits,
        )

    faults.hit("tool.before_claim", call_id=call_id, mode=mode, task_id=task_id_of(execution_id))
    call = again_if_disconnected(claim, "claim a tool call")
    if call is not None and mode == "start":
        # its start is recorded: now, not at its dispatch, watchers hear it started (I9)
        safely(streamed.calls_started, rt.events, task_id_of(execution_id), turn, [call_id])
    if call is None and mode in ("resume", "reconcile"):
        try:
            refused = again_if_disconnected(
                lambda: _refuse(rt, execution_id, turn, call_id), "refuse a take-over"
            )
        except _LookUpFirst as unknown:
            # Its tool is one this process has not met yet (a framework agent's, registered
            # when first named): asked for by the name Charlie recorded, then claimed again.
            # Only a worker that still lacks its implementation refuses, and counts it.
            call = _claimed_once_found(rt, unknown.name, claim)
            refused = None
            if call is None:
                refused = again_if_disconnected(
                    lambda: _refuse(rt, execution_id, turn, call_id, looked=True),
                    "refuse a take-over",
                )
        if refused is not None:
            return refused
    if call is None:
        log.debug("call %s/%s not claimable for %s", execution_id, call_id, mode)
        return "not_claimable", None
    done = execute_call(rt, call, mode)
    if isinstance(done, str):
        return done, None
    return settle_result(rt, done)


class _LookUpFirst(Exception):
    """A take-over refused for a tool this process has no tool of that name for, before its
    registry's finders were asked for it: the refusal is rolled back (not counted)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _claimed_once_found(
    rt: Runtime, name: str, claim: Callable[[], ClaimedCall | None]
) -> ClaimedCall | None:
    """The call, claimed again once its tool was asked for by the name Charlie recorded for it
    (a finder may import the module that defines it: seconds, holding no lease, since nothing
    is claimed); None when no finder registered it here, or another worker claimed it since."""
    try:
        rt.tools.find(name)
    except ToolUnavailable:
        pass  # known, not here now: the claim below fails, and the refusal says why
    except Exception:
        # a finder's import that raised: this worker has no such tool, as before it asked
        log.warning("looking a tool up by its name failed", exc_info=True, extra={"tool": name})
    if rt.tools.get_registered(name) is None:
        return None
    return again_if_disconnected(claim, "claim a tool call")


def _refuse(
    rt: Runtime, execution_id: str, turn: int, call_id: str, *, looked: bool = False
) -> tuple[str, int | None] | None:
    """A take-over this worker cannot do: the call was started with an implementation it
    lacks. It is left for a worker that has it (the sweep publishes the
    take-over again next stall period), and the refusal counts an attempt; the refusal that
    reaches CHARLIE_MAX_ATTEMPTS settles the call ``interrupted``, naming the implementation,
    since no worker that could run it has come for it. None: not a refusal (someone live holds
    the call, it settled, ...). _LookUpFirst, nothing written, when this worker has no tool of
    the call's name and has not ``looked`` for it by that name yet."""
    now = utcnow()
    refused: list[calls.Refusal] = []

    def settle(conn: Connection) -> bool:
        refusal = calls.refuse_claim(
            conn, execution_id, turn, call_id, rt.tools.implementations(), now
        )
        if refusal is None:
            return False
        if not looked and rt.tools.get_registered(refusal.name) is None:
            raise _LookUpFirst(refusal.name)  # (rolls the counted attempt back)
        refused.append(refusal)
        if refusal.attempts < rt.settings.max_attempts:
            return False
        definition = rt.tools.get(refusal.name)
        evidence: JSON = {
            "reason": f"it was started with {refusal.implementation}, which the workers that "
            f"took it over {refusal.attempts - 1} times do not have (this one has "
            f"{definition.implementation if definition else 'no tool of its name'}); "
            "no other implementation is run in its place",
            "implementation": refusal.implementation,
            "started_at": refusal.started_at.isoformat() if refusal.started_at else None,
            "started_by": refusal.started_by,
            "attempts": refusal.attempts,
            "handle": refusal.handle,
        }
        if refusal.on_interrupt == "hold":
            # Its lease lapsed (the refusal's condition), so it is held as a sweep holds one.
            return calls.hold_interrupted(conn, execution_id, turn, call_id, evidence, now)
        return calls.settle_call(
            conn,
            execution_id,
            turn,
            call_id,
            Outcome.INTERRUPTED.value,
            evidence,
            rt.worker,
            now,
        )

    settled, await_version = settle_in_turn(rt, execution_id, turn, settle)
    if not refused:
        return None
    extra = {
        "execution_id": execution_id,
        "call_id": call_id,
        "implementation": refused[0].implementation,
        "attempts": refused[0].attempts,
    }
    if settled:
        log.warning("call interrupted: no worker has its implementation", extra=extra)
        return "interrupted", await_version
    log.info("take-over refused: this worker lacks the call's implementation", extra=extra)
    return "refused", None


def observe_overdue_wait(rt: Runtime, execution_id: str, turn: int, call_id: str) -> str:
    """Look once more at the outside work of a wait that settled past its deadline (I13).

    Its end, when seen, is the call's late report (I12): recorded once however many observers
    saw it, and the call's outcome stays. While it still runs the late watch looks again later;
    nothing is claimed, since the call is settled and its run may have moved on or ended."""

    def load() -> ClaimedCall | None:
        with read(rt.engine) as conn:
            return calls.load_overdue_wait(conn, execution_id, turn, call_id)

    call = again_if_disconnected(load, "load an overdue wait")
    if call is None:
        return "not_observable"
    try:
        done = execute_call(rt, call, "observe")
    except LookFailed as exc:
        # Only an answer from the tool (a result, a ToolError) ends the watch: a failed look
        # recorded as the work's end would hide the real one.
        log.warning(
            "overdue wait: look failed, will look again",
            extra={"execution_id": execution_id, "call_id": call_id, "error": str(exc)},
        )
        return "look_failed"
    if isinstance(done, str):
        return done

    def record() -> bool:
        with write_one(rt.engine) as conn:
            return calls.record_late_report(
                conn, execution_id, turn, call_id, done.outcome.value, done.result, first_only=True
            )

    if not again_if_disconnected(record, "record a late report"):
        return "already_reported"
    log_settled(rt, done, False)
    return "late"


def cancel_outside_work(rt: Runtime, execution_id: str, turn: int, call_id: str) -> str:
    """Ask the outside work of a call Charlie canceled to stop, through its tool's cancel hook
    (an MCP task: tasks/cancel). The call's outcome stays ``canceled`` (I12); nothing is
    claimed or settled, and a failure is only logged: the work was never assumed stopped."""

    def load() -> ClaimedCall | None:
        with read(rt.engine) as conn:
            return calls.load_canceled_call(conn, execution_id, turn, call_id)

    call = again_if_disconnected(load, "load a canceled call")
    definition = rt.tools.get(call.name) if call is not None else None
    if call is None or definition is None or definition.cancel is None:
        return "nothing_to_cancel"
    if call.implementation is not None and call.implementation != definition.implementation:
        return "nothing_to_cancel"  # another tool of the name: not its work to stop
    task_id = task_id_of(execution_id)
    metadata = call.task_metadata or {}
    ctx = ToolContext(
        task_id=task_id,
        execution_id=execution_id,
        call_id=call_id,
        turn=turn,
        workspace=workspace_for(rt, task_id, metadata),
        metadata=metadata,
        resumed=True,
        handle=call.handle,
        _record_handle=lambda handle: None,
        children=DbChildren(rt),
    )
    extra = {"execution_id": execution_id, "call_id": call_id, "handle": call.handle}
    kw = {definition.context_param: ctx} if definition.context_param else {}
    try:
        definition.cancel(**{**call.arguments, **kw})
    except Exception as exc:
        log.warning("could not cancel a canceled call's outside work: %s", exc, extra=extra)
        return "cancel_failed"
    log.info("asked a canceled call's outside work to stop", extra=extra)
    return "cancel_sent"


def execute_call(rt: Runtime, call: ClaimedCall, mode: Mode) -> CallResult | str:
    """Run the handler of a call whose start (or take-over) is committed (I9): a result to
    settle, or ``"parked"``/``"lost_lease"`` for a resumable wait that is still waiting
    (``"still_running"`` when observing an overdue wait, which is not parked)."""
    faults.hit("tool.after_started", tool=call.name, mode=mode, call_id=call.call_id)
    started = time.perf_counter()
    definition = rt.tools.get_registered(call.name)
    unavailable: str | None = None
    try:
        if definition is None and mode != "observe":
            # A tool found by name when first named in this process (a framework agent's, its
            # module imported now) may take longer to load than a lease lasts: held meanwhile
            # (I5).
            with _call_heartbeat(rt, call):
                definition = rt.tools.find(call.name)
        elif definition is None:
            definition = rt.tools.find(call.name)
    except ToolUnavailable as exc:
        # known, not here now, and nothing of the call sent: said so, as the fleet's MCP
        # tools say a server that is down (I36), not hidden behind "not registered"
        unavailable = str(exc)
    if unavailable is not None:
        outcome, result = Outcome.ERROR, {"error": unavailable, "sent": False}
    elif definition is None:
        outcome, result = Outcome.ERROR, {"error": f"tool {call.name!r} is not registered here"}
    else:
        lease: Held | None = None

        def keep_handle(handle: str) -> None:
            def record() -> bool:
                with write_one(rt.engine) as c:
                    return calls.record_handle(c, call, rt.worker, handle)

            # The handle names work already running outside (I20): it must not be lost to a
            # connection that died since the claim.
            if not again_if_disconnected(record, "record a call's handle"):
                if lease is not None:
                    lease.lost.set()
                raise LeaseLost(
                    "this attempt no longer holds the call (its lease lapsed and it was taken "
                    "over or settled); the handle was not recorded",
                    handle=handle,
                )

        task_id = task_id_of(call.execution_id)
        metadata = call.task_metadata or {}
        asked_info = call.hold_info if isinstance(call.hold_info, dict) else {}
        answered = mode == "resume" and asked_info.get("answer") is not None
        ctx = ToolContext(
            task_id=task_id,
            execution_id=call.execution_id,
            call_id=call.call_id,
            turn=call.turn,
            workspace=workspace_for(rt, task_id, metadata),
            refusal=workspace_refusal(rt, metadata),
            metadata=metadata,
            resumed=mode in ("resume", "observe"),
            handle=call.handle,
            _record_handle=keep_handle,
            overdue=mode == "observe",
            children=DbChildren(rt),
            record=DbRecord(rt),
            answer=str(asked_info["answer"]) if answered else None,
            asked=(asked_info.get("asked") or {}) if answered else None,
        )
        # An overdue wait is settled: it has no lease to renew.
        with _call_heartbeat(rt, call) if mode != "observe" else nullcontext() as held:
            if held is not None:
                lease = held
                ctx.lease_lost = held.lost
                ctx._confirm_lease = held.confirm
            if mode == "reconcile" and definition.reconcile is None:
                # The sweep asked on behalf of an implementation it does not have itself; this
                # one has no read-back, so the call is what any interrupted call is (I10).
                evidence: JSON = {**_evidence(call), "reconciled": False}
                outcome, result = Outcome.INTERRUPTED, evidence
            elif mode == "reconcile":
                outcome, result = run_reconcile(definition, call.arguments, ctx, _evidence(call))
            else:
                outcome, result = run_handler(definition, call.arguments, ctx)
    faults.hit("tool.before_settle", tool=call.name, call_id=call.call_id)
    if outcome is Outcome.ERROR and isinstance(result, dict) and bool(result.get("lease_lost")):
        # The handler stopped because this attempt lost the call (LeaseLost): it says nothing
        # about the work, so it is neither the outcome nor a late report.
        log.warning(
            "handler stopped: lease lost",
            extra={"execution_id": call.execution_id, "call_id": call.call_id, "mode": mode},
        )
        return "lost_lease"
    if isinstance(result, Pending | AskPerson):
        if mode == "observe":
            return "still_running"
        if (
            outcome is Outcome.OK
            and definition is not None
            and (definition.resumable or definition.parks)
        ):
            if isinstance(result, AskPerson):
                return _ask(rt, call, result)
            return _park(rt, call, result)
        outcome, result = Outcome.ERROR, {"error": f"{call.name!r} is not a resumable wait"}
    result = cap_result(result, rt.settings.max_result_bytes)
    return CallResult(call, outcome, result, (time.perf_counter() - started) * 1000, mode)


def _park(rt: Runtime, call: ClaimedCall, pending: Pending) -> str:
    poll_at = utcnow() + timedelta(seconds=max(0.1, pending.poll_after))
    with write(rt.engine) as conn:
        parked = calls.park_call(conn, call, rt.worker, pending.handle, poll_at)
    log.debug("wait parked", extra={"call_id": call.call_id, "handle": pending.handle})
    return "parked" if parked else "lost_lease"


def _ask(rt: Runtime, call: ClaimedCall, ask: AskPerson) -> str:
    """Park a started call held for a person's reply (charlie.reply): no owner, no lease, no
    message (I25), its deadline a question's (CHARLIE_HUMAN_DEADLINE from now, never earlier
    than the one it had). The question's id tells one round of questions from the next, so a
    reply answers the question asked now, once (I24)."""
    now = utcnow()
    deadline = now + timedelta(seconds=rt.settings.human_deadline)
    if call.deadline_at is not None and call.deadline_at > deadline:
        deadline = call.deadline_at
    info: JSON = {
        "question": ask.question,
        "question_id": uuid.uuid4().hex,
        "asked_at": now.isoformat(),
        "asked": ask.state,
    }
    with write(rt.engine) as conn:
        calls.lock_run(conn, call.execution_id)  # settlers' order: the run, then the call
        asked = calls.park_for_answer(
            conn, call, rt.worker, handle=ask.handle, info=info, deadline_at=deadline
        )
    log.info(
        "call asks a person" if asked else "question not parked: lease lost",
        extra={"execution_id": call.execution_id, "call_id": call.call_id, "tool": call.name},
    )
    return "asking" if asked else "lost_lease"


def poke_waiters(rt: Runtime, task_id: str) -> None:
    """A task finished: observe the parked waits on it now rather than at their next poll,
    and the overdue ones too, for their late report (I13)."""
    with read(rt.engine) as conn:
        rows = calls.waiters_on(conn, task_id)
    for row in rows:
        mode: Mode = "resume" if row.state == CallState.STARTED.value else "observe"
        rt.publisher.invoke(row.execution_id, row.turn, row.call_id, mode, priority=row.priority)
