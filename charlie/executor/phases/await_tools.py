"""await_tools: settle calls past their deadline (I13); advance once the whole turn settled (I7).

Otherwise the run waits without a new version: the invocation that settles the last call
publishes the next await tick, and the sweep wakes the run at the earliest deadline.
"""

from __future__ import annotations

from charlie.domain import CallState, Outcome, Phase, RunView, Settlement, Transition
from charlie.ports import PhaseDeps

NEEDS = frozenset({"calls"})


def run(view: RunView, deps: PhaseDeps) -> Transition:
    settle = []
    open_deadlines = []
    for call in view.calls:
        if call.state is CallState.SETTLED:
            continue
        if call.deadline_at is not None and call.deadline_at <= view.now:
            seconds = (
                (call.deadline_at - call.queued_at).total_seconds() if call.queued_at else None
            )
            settle.append(
                Settlement(
                    call.call_id,
                    Outcome.DEADLINE_EXCEEDED,
                    {
                        "deadline_seconds": seconds,
                        "deadline_at": call.deadline_at.isoformat(),
                        "started_at": call.started_at.isoformat() if call.started_at else None,
                        "note": "the work was not canceled and may still finish",
                    },
                )
            )
        else:
            open_deadlines.append(call.deadline_at)
    unsettled = len(open_deadlines)
    if unsettled == 0:
        return Transition(to=Phase.ADVANCE_TURN, settle=settle)
    known = [d for d in open_deadlines if d is not None]
    wait = Transition.wait(wake_at=min(known) if known else None, note=f"{unsettled} open")
    wait.settle = settle
    return wait
