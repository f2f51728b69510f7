"""The mailbox at a turn boundary: messages people sent enter the transcript as user input,
once, in commit order, after the turn's results and before the next model call (I22).

The shell loads a run's waiting messages only when its claim says there are some (the run's
``inbox`` count rides in every claim), and marks each delivered in the transaction that writes
its item; a message committed after that transaction began waits for the next boundary.
"""

from __future__ import annotations

from dataclasses import replace

from charlie.domain import ItemKind, NewItem, Phase, RunView, Transition


def take_messages(view: RunView, transition: Transition) -> Transition:
    """Append the waiting messages to ``transition``'s items, after what it writes already."""
    for message in view.messages:
        transition.take_messages.append((message.id, len(transition.items)))
        transition.items.append(
            NewItem(
                ItemKind.INPUT,
                {
                    "role": "user",
                    "content": message.text,
                    "message_id": message.message_id,
                    "sent_by": message.sent_by,
                },
            )
        )
    return transition


def is_final_answer(transition: Transition) -> bool:
    """The model's final answer (not a stop, which goes to report_terminal too)."""
    return any(i.kind is ItemKind.FINAL for i in transition.items)


def reopen_final(view: RunView, transition: Transition) -> Transition:
    """A final answer committed while messages wait: it becomes an assistant message, the
    messages follow it, and the run calls the model again at the next turn (I22, I16). Not a
    stop: it stays a stop (I18), and has taken the waiting messages in itself."""
    if not view.messages or not is_final_answer(transition):
        return transition
    items = [
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": i.payload.get("content", "")})
        if i.kind is ItemKind.FINAL
        else i
        for i in transition.items
    ]
    reopened = replace(
        transition,
        to=Phase.CALL_MODEL,
        items=items,
        next_turn=True,
        take_messages=[],
        note=f"{len(view.messages)} message(s) arrived with the final answer",
    )
    return take_messages(view, reopened)
