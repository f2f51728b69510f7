"""Charlie: a durable executor for long-running LLM agent tasks, on Celery.

The public names: ``submit``, ``get_task``, ``list_tasks``, ``wait``, ``cancel``,
``transcript``, ``calls``, ``history``, ``events`` (a run as it happens) and ``tool``;
people in the loop ``send``, ``reply``, ``approve``, ``deny``, ``reconcile``, ``resume``,
``fork`` and ``actions`` (pinned by tests/unit/test_exports.py).
Tool authors also have :mod:`charlie.testing`; Celery-only producers the task
``charlie.submit``.
"""

from typing import Any

from charlie.tools.registry import tool

__all__ = [
    "actions",
    "approve",
    "calls",
    "cancel",
    "deny",
    "events",
    "fork",
    "get_task",
    "history",
    "list_tasks",
    "reconcile",
    "reply",
    "resume",
    "send",
    "submit",
    "tool",
    "transcript",
    "wait",
]

#: The names served from charlie.api on first use.
_API = frozenset(set(__all__) - {"tool"})
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The API pulls in Celery and SQLAlchemy; importing `charlie` to declare tools should not.
    if name in _API:
        from charlie import api

        return getattr(api, name)
    raise AttributeError(f"module 'charlie' has no attribute {name!r}")
