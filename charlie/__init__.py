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


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("charlie")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


#: The names served from charlie.api on first use.
_API = frozenset(set(__all__) - {"tool"})
#: The installed distribution's version (pyproject.toml's, through the package metadata: one
#: place to change it); `charlie --version` prints the same.
__version__ = _installed_version()


def __getattr__(name: str) -> Any:
    # The API pulls in Celery and SQLAlchemy; importing `charlie` to declare tools should not.
    if name in _API:
        from charlie import api

        return getattr(api, name)
    raise AttributeError(f"module 'charlie' has no attribute {name!r}")
