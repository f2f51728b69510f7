"""What a committed step tells people watching (charlie/streams), after its commit.

Called once a step's transaction has committed, never before, so a reader never sees a tool
call, a wait or an end that did not happen (I28: and no phase ever reads these back). Built from
the committed transition itself: no query, no write.
"""

from __future__ import annotations

import json
from typing import Any

from charlie.domain import ItemKind, Phase, RunView, Transition
from charlie.streams.sink import EventSink, clip


def settled_id(turn: int, call_id: str) -> str:
    """A call's settle event's id: a call settles once (I12), so every event telling it, from
    whichever process committed it, carries this id and a reader keeps one."""
    return f"tool_settled:{turn}:{call_id}"


def _arguments(value: Any) -> str:
    return clip(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def committed(events: EventSink, view: RunView, turn: int, transition: Transition) -> None:
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
    for call_id, _deadline in transition.queue_calls:
        events.emit(task_id, "tool_started", turn=turn, call_id=call_id)
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
