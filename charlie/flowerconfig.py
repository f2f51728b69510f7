"""Flower's settings for `charlie flower` (loaded with Flower's --conf).

Workers already send ``charlie.submit``'s arguments redacted (charlie/redact.py); this also
covers what a producer's own ``task-sent`` events carry, for Flower's pages."""

from __future__ import annotations

from typing import Any

REDACTED = "<redacted by Charlie: prompt and metadata are not shown>"


def format_task(task: Any) -> Any:
    # Always, not only where the repr looks unredacted: a prompt can contain any text, the
    # shape of the redacted repr included.
    if getattr(task, "name", None) == "charlie.submit":
        task.args = REDACTED
        task.kwargs = REDACTED
    return task
