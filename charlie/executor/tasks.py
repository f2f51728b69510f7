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
    def tick(self: Task, execution_id: str, version: int) -> str:
        from charlie.executor.tick import run_tick

        # A redelivered message (RabbitMQ gives back a dead worker's unacked message at once)
        # may be the one that killed it: its claim is committed on its own, so the attempt is
        # counted even if this worker dies too (poison messages).
        redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
        return run_tick(get_runtime(), execution_id, phase, version, durable_claim=redelivered)

    tick.__name__ = phase.value
    tick.__doc__ = f"Run the {phase.value} phase of one execution at one version."
    return app.task(name=f"charlie.phase.{phase.value}", ignore_result=True, bind=True)(tick)


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
