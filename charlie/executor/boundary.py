"""Transitions the tick makes around a phase: stopping a canceled or timed-out task (I18),
failing a run whose phase raised (I17), and ending a poison message. Pure, like the phases."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from charlie.domain import (
    ENDING_PHASES,
    CallState,
    Hold,
    ItemKind,
    NewItem,
    Outcome,
    Phase,
    RunView,
    Settlement,
    TaskSpend,
    TaskStatus,
    TaskView,
    Transition,
)
from charlie.executor.phases.mailbox import take_messages
from charlie.models.base import render_tool_result
from charlie.pricing import PriceTable, exceeded, exceeded_by, spent

TOOL_PHASES = frozenset({Phase.DISPATCH_TOOLS, Phase.AWAIT_TOOLS, Phase.ADVANCE_TURN})


def stop_reason(view: RunView) -> TaskStatus | None:
    """The lifecycle outcome that stops this run at this boundary, if any."""
    return stop_reason_of(view.phase, view.task, view.now)


def stop_reason_of(phase: Phase, task: TaskView, now: datetime) -> TaskStatus | None:
    """stop_reason, from what a claim holds (before its view is read: a stop takes the mail
    in, so the shell reads the mailbox for it, I22)."""
    if phase in ENDING_PHASES:
        return None
    status = task.status
    if status in (TaskStatus.CANCELED, TaskStatus.TIMED_OUT):
        return status
    if task.timeout_at is not None and task.timeout_at <= now:
        return TaskStatus.TIMED_OUT
    if status.terminal:  # failed or succeeded elsewhere: nothing more to do
        return status
    return None


#: Boundaries where a stop takes the waiting messages in (I22): every call of the turn has its
#: result once the stop closed it, and the model is not called before them. (load_context's
#: stop is not one: the prompt is not written yet; load_context takes the mail when resumed.)
MAIL_AT_STOP = TOOL_PHASES | {Phase.CALL_MODEL}

#: What the model is told a closed call ended by (the recorded reason, not always a cancel).
_STOPPED = {
    TaskStatus.CANCELED: "the task was canceled",
    TaskStatus.TIMED_OUT: "the task timed out",
    TaskStatus.FAILED: "the task failed",
    TaskStatus.SUCCEEDED: "the task had already ended",
}
RUN_FAILED = "the run failed"


def over_budget(view: RunView, prices: PriceTable) -> Transition | None:
    """Before a model call: if the durable usage has reached any limit of the task's
    budget, the model is not called; the run fails, its error naming the budget, its limit and
    what was used. None: within budget, or no budget.

    In a delegation tree the task's budget counts its own spend and its delegated tasks', and
    the budget of each task above it counts that task's whole subtree: a child stops when its
    parent's budget is spent, not only its own (its own began as what its parent had left)."""
    task = view.task
    if view.phase is not Phase.CALL_MODEL or not task.budget:
        return None
    if task.tree is None or all(t.task_id != task.id for t in task.tree):
        reached = exceeded(task.budget, task.usage or {}, task.model, prices)
    else:
        reached = None
        for scope, used, size in budget_scopes(task.id, task.tree, prices):
            reached = exceeded_by(scope.budget, used)
            if reached is None:
                continue
            if scope.task_id != task.id:
                reached["budget_of"] = scope.task_id
                reached["message"] = (
                    f"the budget of task {scope.task_id}, which this task was delegated under, "
                    f"is spent by it and the tasks it delegated: {reached['message']}"
                )
            elif size > 1:
                reached["message"] += " (this task's spend and its delegated tasks')"
            break
    if reached is None:
        return None
    error = {
        "phase": view.phase.value,
        "type": "BudgetExceeded",
        "kind": "budget",
        "traceback": None,
        "attempt": view.attempts,
        **reached,
    }
    return Transition(
        to=Phase.REPORT_FAILURE,
        state={**view.state, "error": error},
        note=str(reached["message"])[:200],
    )


def budget_scopes(
    task_id: str, tree: Sequence[TaskSpend], prices: PriceTable
) -> list[tuple[TaskSpend, dict[str, Any], int]]:
    """The budgets a task in a delegation tree spends against, nearest first: its own and each
    budgeted ancestor's in ``tree``, each with what its subtree has spent (pricing.spent) and
    how many tasks that subtree holds."""
    by_id = {t.task_id: t for t in tree}
    children: dict[str, list[TaskSpend]] = {}
    for t in tree:
        if t.parent_id is not None:
            children.setdefault(t.parent_id, []).append(t)
    scopes = []
    seen: set[str] = set()
    current = by_id.get(task_id)
    while current is not None and current.task_id not in seen:
        seen.add(current.task_id)
        if current.budget:
            subtree, stack = [], [current]
            while stack:
                node = stack.pop()
                subtree.append(node)
                stack.extend(children.get(node.task_id, ()))
            used = spent([(t.model, t.usage) for t in subtree], prices)
            scopes.append((current, used, len(subtree)))
        current = by_id.get(current.parent_id) if current.parent_id is not None else None
    return scopes


def close_turn(
    view: RunView, reason: str, *, with_items: bool = True
) -> tuple[list[Settlement], list[NewItem]]:
    """End a tool phase's turn early: open calls settle ``canceled`` and, with ``with_items``,
    every call of the turn gets its result item, so no call is left without one (I8)."""
    settle: list[Settlement] = []
    items: list[NewItem] = []
    if view.phase not in TOOL_PHASES:
        return settle, items
    for call in sorted(view.calls, key=lambda c: c.index):
        if call.state is CallState.SETTLED:
            assert call.outcome is not None
            outcome, result = call.outcome, call.result
        elif call.hold is Hold.RECONCILE:
            # Started and interrupted, its verdict never given: it may have happened, and the
            # model (after a resume) must not read it as not done (I10).
            evidence = (call.hold_info or {}).get("evidence")
            outcome = Outcome.INTERRUPTED
            result = {
                **(evidence if isinstance(evidence, dict) else {"evidence": evidence}),
                "held_for_a_verdict": f"the run ended ({reason}) before an operator decided",
            }
            settle.append(Settlement(call.call_id, outcome, result))
        else:
            outcome, result = Outcome.CANCELED, {"reason": reason}
            settle.append(Settlement(call.call_id, outcome, result))
        items.append(
            NewItem(
                ItemKind.TOOL_RESULT,
                {
                    "name": call.name,
                    "outcome": outcome.value,
                    "result": result,
                    "content": render_tool_result(outcome, result),
                },
                call_id=call.call_id,
            )
        )
    return settle, items if with_items else []


def stop(view: RunView, reason: TaskStatus) -> Transition:
    """Stop at the boundary; the model is not called again (I18). The turn closed, the
    messages waiting enter after its results (I22): a resume's next model call is shown them,
    and a run never resumed still has them, once, where they arrived."""
    settle, items = close_turn(view, _STOPPED.get(reason, f"the task {reason.value}"))
    stopped = Transition(
        to=Phase.REPORT_TERMINAL,
        # Where it stopped, for a resume (charlie.resume) to re-enter there.
        state={**view.state, "stop": reason.value, "stopped_in": view.phase.value},
        settle=settle,
        items=items,
        note=f"stopped at boundary: task {reason.value}",
    )
    return take_messages(view, stopped) if view.phase in MAIL_AT_STOP else stopped


def take_mail(view: RunView) -> Transition | None:
    """call_model's boundary (I22): messages that wait when the model is about to be called
    (a run resumed or re-entered after a stop or a failure that closed its turn, a message
    committed after the boundary before this claim) enter the transcript first, in a step of
    their own (call_model -> call_model), so the model input is the transcript as committed
    (I6, I29); the next step calls the model with them."""
    if view.phase is not Phase.CALL_MODEL or not view.messages:
        return None
    return take_messages(
        view,
        Transition(
            to=Phase.CALL_MODEL,
            state=view.state,
            note=f"{len(view.messages)} message(s) taken in before the model call",
        ),
    )


def error_state(view: RunView, exc: BaseException, kind: str = "exception") -> dict[str, Any]:
    tb = "".join(traceback.format_exception(exc))
    return {
        "phase": view.phase.value,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": tb[-8000:],
        "attempt": view.attempts,
        "kind": kind,
        "evidence": getattr(exc, "evidence", None),
    }


def fail(view: RunView, exc: BaseException) -> Transition:
    """I17: a phase raised; store the structured error and report it as a phase of its own."""
    error = error_state(view, exc)
    settle, items = close_turn(view, RUN_FAILED)
    return Transition(
        to=Phase.REPORT_FAILURE,
        state={**view.state, "error": error},
        settle=settle,
        items=items,
        note=f"{error['type']} in {view.phase.value}: {error['message'][:200]}",
    )


def poison(view: RunView, max_attempts: int) -> Transition:
    """A tick claimed too many times without finishing: its worker keeps dying."""
    cause = (
        f"the last attempt failed: {view.last_error.get('message')}"
        if view.last_error
        else "its worker likely died each time"
    )
    message = (
        f"phase {view.phase.value} (version {view.version}) was claimed {view.attempts} "
        f"times without completing (limit {max_attempts}); {cause}"
    )
    error: dict[str, Any] = {
        "phase": view.phase.value,
        "type": "PoisonMessage",
        "message": message,
        "traceback": None,
        "attempt": view.attempts,
        "kind": "poison",
        "last_error": view.last_error,
    }
    if view.phase is Phase.REPORT_FAILURE:
        # Even reporting keeps dying: end the run; the shell marks the task failed directly.
        return Transition(to=Phase.DONE, state={**view.state, "poison": error}, note="poison")
    # Open calls still settle, so none is dispatched again; result items are left out when the
    # database has been refusing this run's writes, or the poison transition could not commit.
    settle, items = close_turn(view, RUN_FAILED, with_items=view.last_error is None)
    return Transition(
        to=Phase.REPORT_FAILURE,
        state={**view.state, "error": error},
        settle=settle,
        items=items,
        note=message,
    )
