"""dispatch_tools: queue at most K never-started calls of this turn for invocation (I11, I14).

The shell marks them queued, with their deadlines, in the transition's transaction and publishes
one invoke message per call after the commit. Calls left over wait for the next dispatch tick.

Calls held for a person are not dispatched (I23, I25): one that needs approval stays pending,
never queued, until an approve queues it; a question to a person is marked queued with its
deadline but no worker is sent (a reply settles it). Either way the task is ``waiting`` while
the turn's other calls run.
"""

from __future__ import annotations

from datetime import timedelta

from charlie.domain import CallState, Effect, Hold, Phase, RunView, TaskStatus, Transition
from charlie.ports import PhaseDeps

NEEDS = frozenset({"calls"})


def run(view: RunView, deps: PhaseDeps) -> Transition:
    waiting = sorted(
        (
            c
            for c in view.calls
            if c.state is CallState.PENDING and c.queued_at is None and c.hold is not Hold.APPROVAL
        ),
        key=lambda c: c.index,
    )
    batch = waiting[: max(1, deps.limits.dispatch_batch)]
    queue = []
    asks = []
    waits_on_work = any(c.hold is not None for c in view.calls if c.state is not CallState.SETTLED)
    for call in batch:
        definition = deps.tools.get(call.name)
        if call.hold is Hold.REPLY:
            seconds = (
                definition.deadline
                if definition and definition.deadline is not None
                else deps.limits.human_deadline
            )
            asks.append((call.call_id, view.now + timedelta(seconds=seconds)))
            continue
        seconds = (
            definition.deadline
            if definition and definition.deadline is not None
            else deps.limits.tool_deadline
        )
        queue.append((call.call_id, view.now + timedelta(seconds=seconds)))
        waits_on_work |= bool(definition and definition.effect is Effect.WAIT)
    more = len(waiting) > len(batch)
    # The shell holds the turn's calls locked while this runs, so what is open now stays open
    # until the commit; a call settling after it sees the run in await_tools and runs that tick.
    still_open = bool(batch) or any(c.state is not CallState.SETTLED for c in view.calls)
    return Transition(
        to=Phase.DISPATCH_TOOLS if more else Phase.AWAIT_TOOLS,
        queue_calls=queue,
        ask_calls=asks,
        task_status=TaskStatus.WAITING
        if waits_on_work and view.task.status is not TaskStatus.WAITING
        else None,
        # Into await_tools, no tick while calls are open: the call that settles last runs it
        # (an await tick now would find the turn still running).
        publish_next=more or not still_open,
        note=f"queued {len(batch)}, {len(waiting) - len(batch)} left",
    )
