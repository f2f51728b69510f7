"""The public face of ``charlie`` is pinned: a name added or dropped is a decision, not a slip
(as temporalio's tests/test_workflow_exports.py pins its workflow module)."""

from __future__ import annotations

import subprocess
import sys

import charlie

PUBLIC = [
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


def test_all_is_pinned() -> None:
    assert sorted(charlie.__all__) == PUBLIC


def test_every_public_name_resolves() -> None:
    for name in charlie.__all__:
        assert callable(getattr(charlie, name)), name


def test_the_api_names_are_the_api_functions() -> None:
    from charlie import api

    for name in PUBLIC:
        if name != "tool":
            assert getattr(charlie, name) is getattr(api, name)


def test_declaring_a_tool_imports_neither_celery_nor_sqlalchemy() -> None:
    # `import charlie` to declare tools must stay cheap (the API is served lazily).
    code = (
        "import sys, charlie\n"
        "@charlie.tool\n"
        "def ping(text: str) -> str:\n"
        "    return text\n"
        "heavy = [m for m in ('celery', 'sqlalchemy', 'charlie.api') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
