"""The Celery app: the shell that carries ticks and tool invocations between processes."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import worker_process_init, worker_ready

app = Celery("charlie")
app.config_from_object("celeryconfig")
app.conf.include = ["charlie.executor.tasks", "charlie.tools.tasks", "charlie.sweeps"]


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # A prefork child must open its own database connections and take its own worker identity.
    from charlie import runtime

    runtime.reset_after_fork()


@worker_ready.connect
def _ready(**_: Any) -> None:
    from charlie import runtime

    runtime.get_runtime()  # fail fast on a missing schema or a bad tool module
