"""The Celery app: the shell that carries ticks and tool invocations between processes."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    worker_process_init,
    worker_ready,
)

app = Celery("charlie")
app.config_from_object("celeryconfig")
app.conf.include = ["charlie.executor.tasks", "charlie.tools.tasks", "charlie.sweeps"]


@after_setup_logger.connect
@after_setup_task_logger.connect
def _structured_logs(logger: logging.Logger, **_: Any) -> None:
    # Celery's format string prints no context; each line should say which run it is about.
    from charlie import logs
    from charlie.config import settings

    logs.install(logger, json_lines=settings().log_format == "json")


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    # A prefork child must open its own database connections and take its own worker identity.
    from charlie import runtime

    runtime.reset_after_fork()


@worker_ready.connect
def _ready(**_: Any) -> None:
    from charlie import runtime

    runtime.get_runtime()  # fail fast on a missing schema or a bad tool module
