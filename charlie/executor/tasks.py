"""The Celery tasks of the loop: one per phase, named ``charlie.phase.<phase>`` (I21).

A message carries (execution_id, version); the task name is the phase. Each task is a thin
shell over :func:`charlie.executor.tick.run_tick`, and safe to run twice, late or never (I2).
"""

from __future__ import annotations

from celery import Task
from sqlalchemy.exc import OperationalError

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


# A submit that finds the database unreachable is published again with backoff (2 s doubling
# to 60 s, about 10 minutes in all) before the message is given up with an error naming the
# task; the countdowns stay far below Redis's visibility timeout (CELERY-NOTES.md).
@app.task(
    name="charlie.submit",
    ignore_result=True,
    bind=True,
    autoretry_for=(OperationalError,),
    retry_backoff=2,
    retry_backoff_max=60,
    max_retries=15,
)
def submit_task(
    self: Task,
    prompt: str,
    *,
    model: str,
    task_id: str | None = None,
    tools: list[str] | None = None,
    timeout: float | None = None,
    metadata: dict[str, object] | None = None,
) -> str:
    """Start a Charlie task from a producer that has only Celery: ``submit_task.delay(...)`` or
    ``app.send_task("charlie.submit", kwargs=...)``, which a plain Celery app sends to its default
    queue (``celery``), which Charlie's workers consume too.

    The task's id is ``task_id`` if given, else the Celery message's own id
    (``send_task(..., task_id=...)``, or the one Celery generated): a redelivered or retried
    message then submits nothing twice, and the producer's ``AsyncResult.id`` is the Charlie
    task's id."""
    from charlie.api import submit

    return submit(
        prompt,
        model=model,
        tools=tools,
        task_id=task_id or self.request.id,
        timeout=timeout,
        metadata=metadata,
    )
