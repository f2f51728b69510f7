"""Invoking one tool call: mark started (I9) → run the handler → settle, first result wins (I12).

The handler runs outside any transaction while a heartbeat renews the call's lease (I5). A
worker killed mid-handler leaves the call started with a lapsing lease; the sweep then settles
it ``interrupted`` (I10), or re-dispatches it here in ``resume`` mode if the tool is a
resumable wait, or in ``reconcile`` mode if the tool can find out what happened.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select

from charlie import faults
from charlie.domain import JSON, CallState, Outcome, Phase, task_id_of
from charlie.leases import heartbeat
from charlie.runtime import Runtime
from charlie.store import calls, runs
from charlie.store.calls import ClaimedCall, Mode
from charlie.store.engine import read, write
from charlie.store.schema import tool_calls
from charlie.tools.context import Pending, Reconciled, ToolContext, ToolError
from charlie.tools.registry import ToolDef

log = logging.getLogger("charlie.tool")


def utcnow() -> datetime:
    return datetime.now(UTC)


def workspace_for(rt: Runtime, task_id: str, metadata: JSON) -> Path:
    configured = metadata.get("workspace")
    path = Path(configured) if configured else rt.settings.workspaces_dir / task_id
    path.mkdir(parents=True, exist_ok=True)
    return path


def cap_result(result: Any, limit: int) -> Any:
    """Oversized results are cut, and say so, rather than refused: the call still settles."""
    text = json.dumps(result, default=str, ensure_ascii=False)
    if len(text.encode()) <= limit:
        return json.loads(text)
    return {
        "truncated": True,
        "original_bytes": len(text.encode()),
        "head": text.encode()[: limit // 2].decode(errors="ignore"),
    }


def _call_heartbeat(rt: Runtime, call: ClaimedCall) -> AbstractContextManager[None]:
    """Renew the call's lease while its handler runs (I5)."""

    def renew(conn: Connection) -> bool:
        until = utcnow() + timedelta(seconds=rt.settings.lease_seconds)
        return calls.renew_call_lease(conn, call, rt.worker, until)

    return heartbeat(rt.engine, renew, rt.settings.lease_seconds / 3, f"call-{call.call_id}")


def _run_handler(definition: ToolDef, call: ClaimedCall, ctx: ToolContext) -> tuple[Outcome, Any]:
    kwargs = dict(call.arguments)
    if definition.context_param:
        kwargs[definition.context_param] = ctx
    try:
        return Outcome.OK, definition.handler(**kwargs)
    except ToolError as exc:
        return Outcome.ERROR, exc.as_result()
    except Exception as exc:
        # I15: a tool that raises is a result the model sees, not a failed run.
        return Outcome.ERROR, {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))[-4000:],
        }


def _reconcile(definition: ToolDef, call: ClaimedCall, ctx: ToolContext) -> tuple[Outcome, Any]:
    assert definition.reconcile is not None
    evidence = _evidence(call)
    try:
        found = definition.reconcile(**{**call.arguments, **_ctx_kw(definition, ctx)})
    except Exception as exc:
        found = None
        evidence["reconcile_error"] = f"{type(exc).__name__}: {exc}"
    if isinstance(found, Reconciled):
        result = found.result if isinstance(found.result, dict) else {"result": found.result}
        return found.outcome, {**result, "reconciled": True, "evidence": evidence}
    return Outcome.INTERRUPTED, {**evidence, "reconciled": False}


def _ctx_kw(definition: ToolDef, ctx: ToolContext) -> dict[str, Any]:
    return {definition.context_param: ctx} if definition.context_param else {}


def _evidence(call: ClaimedCall) -> JSON:
    return {
        "started_at": call.started_at.isoformat() if call.started_at else None,
        "started_by": call.started_by,
        "attempts": call.attempts,
        "handle": call.handle,
    }


def invoke(rt: Runtime, execution_id: str, turn: int, call_id: str, mode: Mode) -> str:
    with write(rt.engine) as conn:
        now = utcnow()  # after BEGIN, so the lease is not born expired
        call = calls.claim_call(
            conn, execution_id, turn, call_id, mode, rt.worker, now, rt.settings.lease_seconds
        )
        if call is None:
            log.debug("call %s/%s not claimable for %s", execution_id, call_id, mode)
            return "not_claimable"
        task = runs.load_task(conn, task_id_of(execution_id))
    # Dispatch-started is committed (I9). From here on a crash leaves evidence, not a duplicate.
    extra = {"execution_id": execution_id, "call_id": call_id, "tool": call.name, "mode": mode}
    faults.hit("tool.after_started", tool=call.name, mode=mode, call_id=call_id)
    started = time.perf_counter()
    definition = rt.tools.get(call.name)
    if task is None or definition is None:
        outcome, result = Outcome.ERROR, {"error": f"tool {call.name!r} is not registered here"}
    else:

        def keep_handle(handle: str) -> None:
            with write(rt.engine) as c:
                calls.record_handle(c, call, handle)

        ctx = ToolContext(
            task_id=task.id,
            execution_id=execution_id,
            call_id=call_id,
            turn=turn,
            workspace=workspace_for(rt, task.id, task.metadata),
            metadata=task.metadata,
            resumed=mode == "resume",
            handle=call.handle,
            _record_handle=keep_handle,
        )
        with _call_heartbeat(rt, call):
            if mode == "reconcile":
                outcome, result = _reconcile(definition, call, ctx)
            else:
                outcome, result = _run_handler(definition, call, ctx)
    faults.hit("tool.before_settle", tool=call.name, call_id=call_id)
    if isinstance(result, Pending):
        if outcome is Outcome.OK and definition is not None and definition.resumable:
            return _park(rt, call, result)
        outcome, result = Outcome.ERROR, {"error": f"{call.name!r} is not a resumable wait"}
    result = cap_result(result, rt.settings.max_result_bytes)
    duration = (time.perf_counter() - started) * 1000
    with write(rt.engine) as conn:
        settled = calls.settle_call(
            conn,
            execution_id,
            turn,
            call_id,
            outcome.value,
            result,
            rt.worker,
            utcnow(),
            duration,
        )
        if not settled:
            # I12/I13: it was settled meanwhile (deadline, interrupted, canceled): count it.
            calls.record_late_report(conn, execution_id, turn, call_id, outcome.value, result)
    log.info("call settled" if settled else "late report", extra={**extra, "outcome": outcome})
    faults.hit("tool.after_settle", tool=call.name, call_id=call_id)
    if settled:
        poke_if_turn_settled(rt, execution_id, turn)
    return "settled" if settled else "late"


def _park(rt: Runtime, call: ClaimedCall, pending: Pending) -> str:
    poll_at = utcnow() + timedelta(seconds=max(0.1, pending.poll_after))
    with write(rt.engine) as conn:
        parked = calls.park_call(conn, call, rt.worker, pending.handle, poll_at)
    log.debug("wait parked", extra={"call_id": call.call_id, "handle": pending.handle})
    return "parked" if parked else "lost_lease"


def poke_waiters(rt: Runtime, task_id: str) -> None:
    """A task finished: observe the parked waits on it now rather than at their next poll."""
    c = tool_calls.c
    with read(rt.engine) as conn:
        rows = conn.execute(
            select(c.execution_id, c.turn, c.call_id).where(
                c.handle == task_id, c.state == CallState.STARTED.value, c.resumable.is_(True)
            )
        ).all()
    for row in rows:
        rt.publisher.invoke(row.execution_id, row.turn, row.call_id, "resume")


def poke_if_turn_settled(rt: Runtime, execution_id: str, turn: int) -> None:
    """Whoever settles the last call of the turn publishes the await tick (I7)."""
    with read(rt.engine) as conn:
        if runs.count_unsettled(conn, execution_id, turn) != 0:
            return
        position = runs.execution_position(conn, execution_id)
    if position is not None and position[0] is Phase.AWAIT_TOOLS:
        rt.publisher.tick(execution_id, position[0], position[1])
