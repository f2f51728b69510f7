"""What a committed step tells people watching (charlie/streams), after its commit.

Called once a step's transaction has committed, never before, so a reader never sees a tool
call, a wait or an end that did not happen (I28: and no phase ever reads these back). Built from
the committed transition itself: no query, no write.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from charlie.domain import ItemKind, Phase, RunView, Transition
from charlie.streams.sink import EventSink, clip


def settled_id(turn: int, call_id: str) -> str:
    """A call's settle event's id: a call settles once (I12), so every event telling it, from
    whichever process committed it, carries this id and a reader keeps one."""
    return f"tool_settled:{turn}:{call_id}"


def _arguments(value: Any) -> str:
    return clip(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def calls_started(events: EventSink, task_id: str, turn: int, call_ids: Iterable[str]) -> None:
    """``tool_started`` for calls whose start has committed (I9): told once a call (a start is
    recorded once), whoever started it: the dispatch, a tool worker's claim, a sweep's."""
    if not events.enabled:
        return
    for call_id in call_ids:
        events.emit(
            task_id,
            "tool_started",
            event_id=f"tool_started:{turn}:{call_id}",
            turn=turn,
            call_id=call_id,
        )


def committed(
    events: EventSink,
    view: RunView,
    turn: int,
    transition: Transition,
    started: Iterable[str] = (),
) -> None:
    if not events.enabled:
        return
    task_id = view.task.id
    held: list[dict[str, Any]] = []
    for call in transition.calls:
        events.emit(
            task_id,
            "tool_call",
            event_id=f"tool_call:{turn}:{call.call_id}",
            turn=turn,
            call_id=call.call_id,
            name=call.name,
            arguments=_arguments(call.arguments),
            held=call.hold.value if call.hold is not None else None,
        )
        if call.settled is not None:
            events.emit(
                task_id,
                "tool_settled",
                event_id=settled_id(turn, call.call_id),
                turn=turn,
                call_id=call.call_id,
                name=call.name,
                outcome=call.settled[0].value,
            )
        if call.hold is not None:
            info = call.hold_info or {}
            question = info.get("question") if isinstance(info, dict) else None
            held.append(
                {
                    "call_id": call.call_id,
                    "name": call.name,
                    "hold": call.hold.value,
                    "question": clip(str(question)) if question else None,
                }
            )
    if held:
        events.emit(task_id, "waiting", turn=turn, calls=held)
    # A call is announced started when its start is recorded (I9), not when it is queued: the
    # calls this commit started (a local read's, in the dispatch's own commit), and no other
    # (a queued call's claim announces it: calls_started, from whichever worker or sweep).
    calls_started(events, task_id, turn, started)
    names = {c.call_id: c.name for c in view.calls}
    for settled in transition.settle:
        events.emit(
            task_id,
            "tool_settled",
            event_id=settled_id(turn, settled.call_id),
            turn=turn,
            call_id=settled.call_id,
            name=names.get(settled.call_id),
            outcome=settled.outcome.value,
        )
    for item in transition.items:
        if item.kind is ItemKind.FINAL:
            text = clip(str(item.payload.get("content")))
            events.emit(task_id, "final", event_id=f"final:{view.version}", turn=turn, text=text)
    if transition.to is Phase.DONE:
        # (by the step's version: a resumed task that ends again ends in another step)
        end_id = f"end:{view.version}"
        events.emit(task_id, "end", event_id=end_id, turn=turn, note=transition.note)
