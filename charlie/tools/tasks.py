"""The Celery task that invokes one tool call: ``charlie.tool.invoke``."""

from __future__ import annotations

from charlie.app import app
from charlie.runtime import get_runtime


@app.task(name="charlie.tool.invoke", ignore_result=True)
def invoke_task(execution_id: str, turn: int, call_id: str, mode: str = "start") -> str:
    from charlie.tools.invoke import invoke

    if mode not in ("start", "resume", "reconcile", "observe"):
        raise ValueError(f"unknown invoke mode {mode!r}")
    return invoke(get_runtime(), execution_id, turn, call_id, mode)  # type: ignore[arg-type]
