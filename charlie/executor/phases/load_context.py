"""load_context: record the model input boundary (the context items) and start the task."""

from __future__ import annotations

from charlie.domain import ItemKind, NewItem, Phase, RunView, TaskStatus, Transition
from charlie.executor import context
from charlie.executor.phases.mailbox import take_messages
from charlie.ports import PhaseDeps

NEEDS = frozenset({"messages"})

SYSTEM_PROMPT = (
    "You are Charlie, an engineering agent. Work in small verifiable steps using the tools you "
    "are given. Tool results marked INTERRUPTED or DEADLINE EXCEEDED are uncertain: check the "
    "state before repeating an action. When you are done, answer without calling a tool."
)


def run(view: RunView, deps: PhaseDeps) -> Transition:
    system = view.task.metadata.get("system_prompt") or SYSTEM_PROMPT
    tools = [t.name for t in deps.tools.enabled(view.task.tools)]
    planned = context.settings(view.task.model, deps.limits, tools)
    # Messages sent before the task started follow its prompt (I22).
    return take_messages(
        view,
        Transition(
            to=Phase.CALL_MODEL,
            items=[
                NewItem(ItemKind.INPUT, {"role": "system", "content": system}),
                NewItem(ItemKind.INPUT, {"role": "user", "content": view.task.prompt}),
            ],
            task_status=TaskStatus.RUNNING,
            # the settings the first model call plans with, whichever worker makes it (I29)
            state=context.with_settings(view.state, planned),
        ),
    )
