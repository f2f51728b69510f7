"""Charlie: a durable executor for long-running LLM agent tasks, on Celery.

The public names: ``submit``, ``get_task``, ``wait``, ``cancel``, ``transcript`` and ``tool``.
"""

from typing import Any

from charlie.tools.registry import tool

__all__ = ["cancel", "get_task", "submit", "tool", "transcript", "wait"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The API pulls in Celery and SQLAlchemy; importing `charlie` to declare tools should not.
    if name in ("submit", "get_task", "wait", "cancel", "transcript", "calls", "history"):
        from charlie import api

        return getattr(api, name)
    raise AttributeError(f"module 'charlie' has no attribute {name!r}")
