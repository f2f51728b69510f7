"""advance_turn: put the settled outcomes into the transcript in call order (I7, I8)."""

from __future__ import annotations

from datetime import datetime

from charlie.domain import (
    CallState,
    ItemKind,
    NewItem,
    Phase,
    RunView,
    TaskStatus,
    Transition,
)
from charlie.executor.phases.mailbox import take_messages
from charlie.models.base import render_tool_result
from charlie.ports import PhaseDeps

NEEDS = frozenset({"calls", "messages"})


def result_items(view: RunView) -> list[NewItem]:
    items = []
    for call in sorted(view.calls, key=lambda c: c.index):
        assert call.outcome is not None
        items.append(
            NewItem(
                ItemKind.TOOL_RESULT,
                {
                    "name": call.name,
                    "outcome": call.outcome.value,
                    "result": call.result,
                    "content": render_tool_result(call.outcome, call.result),
                },
                call_id=call.call_id,
            )
        )
    return items


def finish_order(view: RunView) -> dict[str, int]:
    """The order calls actually finished in, kept on the records as evidence."""
    far = datetime.max.replace(tzinfo=view.now.tzinfo)
    ordered = sorted(view.calls, key=lambda c: (c.settled_at or far, c.index))
    return {c.call_id: n for n, c in enumerate(ordered, 1)}


def run(view: RunView, deps: PhaseDeps) -> Transition:
    if any(c.state is not CallState.SETTLED for c in view.calls):
        # Only reachable through a stale path; whole turns only (I7).
        return Transition(to=Phase.AWAIT_TOOLS, note="turn not settled")
    # The boundary: the turn's results, then what people sent meanwhile (I22).
    return take_messages(
        view,
        Transition(
            to=Phase.CALL_MODEL,
            items=result_items(view),
            finish_order=finish_order(view),
            next_turn=True,
            task_status=TaskStatus.RUNNING if view.task.status is TaskStatus.WAITING else None,
        ),
    )
