"""report_terminal: derive the task result from the durable final item and record it (I16).

Never calls the model. A transient scheduler-write failure is retried with backoff; past the
in-tick retries the run stores a wake-up time and the sweep brings it back.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from charlie.domain import ItemKind, Phase, RunView, TaskStatus, Transition
from charlie.ports import PhaseDeps, TransientSchedulerError

NEEDS = frozenset({"items"})


def report(
    view: RunView, deps: PhaseDeps, status: TaskStatus, *, result: Any = None, error: Any = None
) -> Transition:
    attempts = int(view.state.get("report_attempts", 0))
    delay = deps.limits.report_backoff * (2**attempts)
    last_error = None
    for _ in range(max(1, deps.limits.report_retries)):
        try:
            accepted = deps.scheduler.finish(view.task.id, status, result=result, error=error)
        except TransientSchedulerError as exc:
            last_error = str(exc)
            attempts += 1
            deps.sleep(delay)
            delay = min(delay * 2, 30.0)
            continue
        return Transition(
            to=Phase.DONE,
            state={**view.state, "report_attempts": attempts, "accepted": accepted},
            publish_next=False,
            note=f"task {status.value}" if accepted else "task already terminal (benign)",
        )
    return Transition(
        to=None,
        state={**view.state, "report_attempts": attempts, "last_report_error": last_error},
        wake_at=view.now + timedelta(seconds=min(delay, 60.0)),
        publish_next=False,
        note=f"scheduler write failed {attempts} times: {last_error}",
    )


def run(view: RunView, deps: PhaseDeps) -> Transition:
    stop = view.state.get("stop")
    if stop:
        return report(view, deps, TaskStatus(stop), error={"reason": f"task {stop}"})
    finals = [i for i in view.items if i.kind is ItemKind.FINAL]
    if not finals:
        raise RuntimeError("report_terminal reached without a final item in the transcript")
    final = finals[-1]
    return report(
        view,
        deps,
        TaskStatus.SUCCEEDED,
        result={"answer": final.payload.get("content", ""), "final_seq": final.seq},
    )
