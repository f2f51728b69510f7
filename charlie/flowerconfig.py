"""Flower's settings for `charlie flower` (loaded with Flower's --conf).

Workers already send ``charlie.submit``'s arguments redacted (charlie/redact.py); this also
covers what a producer's own ``task-sent`` events carry, for Flower's pages."""

from __future__ import annotations

from typing import Any

REDACTED = "<redacted by Charlie: prompt and metadata are not shown>"


def format_task(task: Any) -> Any:
    if getattr(task, "name", None) == "charlie.submit":
        for field in ("args", "kwargs"):
            shown = str(getattr(task, field, "") or "")
            if shown and "<prompt:" not in shown and shown not in ("()", "{}"):
                setattr(task, field, REDACTED)
    return task
