"""The Celery tasks of the loop: one per phase, named ``charlie.phase.<phase>`` (I21).

A message carries (execution_id, version); the task name is the phase. Each task is a thin
shell over :func:`charlie.executor.tick.run_tick`, and safe to run twice, late or never (I2).
"""

from __future__ import annotations

from celery import Task

from charlie.app import app
from charlie.domain import Phase
from charlie.runtime import get_runtime


def _phase_task(phase: Phase) -> Task:
    def tick(execution_id: str, version: int) -> str:
        from charlie.executor.tick import run_tick

        return run_tick(get_runtime(), execution_id, phase, version)

    tick.__name__ = phase.value
    tick.__doc__ = f"Run the {phase.value} phase of one execution at one version."
    return app.task(name=f"charlie.phase.{phase.value}", ignore_result=True)(tick)


PHASE_TASKS = {phase: _phase_task(phase) for phase in Phase if phase is not Phase.DONE}


@app.task(name="charlie.submit", ignore_result=True)
def submit_task(
    prompt: str,
    *,
    model: str,
    task_id: str,
    tools: list[str] | None = None,
    timeout: float | None = None,
    metadata: dict[str, object] | None = None,
) -> str:
    """Start a Charlie task from a producer that has only Celery: ``submit_task.delay(...)`` or
    ``app.send_task("charlie.submit", kwargs=...)``. Pass your own ``task_id``: a redelivered
    message then submits nothing twice."""
    from charlie.api import submit

    return submit(
        prompt, model=model, tools=tools, task_id=task_id, timeout=timeout, metadata=metadata
    )
