"""Named fault points, for tests and chaos runs: kill the worker or raise at an exact place.

Off unless ``CHARLIE_FAULTS`` names a JSON file. Its keys are point names (``tick.after_commit``,
``tool.after_started``, ``scheduler.finish`` ...), each with ``{"action": "kill" | "raise" |
"pause", "times": N, "match": {"phase": ..., "tool": ...}}`` (``pause`` sleeps ``seconds``: a
worker that stalls, say a broker slow to take a publish). ``times`` is shared by every process
through a counter file beside it, under a file lock, so "kill the first worker that gets here,
once" means exactly that across a pool of workers.

``kill`` sends SIGKILL to the worker's whole process group: a worker dying, not an exception.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

_PATH = os.environ.get("CHARLIE_FAULTS")


class InjectedFault(Exception):
    pass


def _take(point: str, context: dict[str, Any]) -> dict[str, Any] | None:
    assert _PATH is not None
    spec_path = Path(_PATH)
    try:
        spec = json.loads(spec_path.read_text()).get(point)
    except (OSError, ValueError):
        return None
    if not spec:
        return None
    for key, wanted in (spec.get("match") or {}).items():
        if str(context.get(key)) != str(wanted):
            return None
    counter = spec_path.with_suffix(".count")
    with open(counter, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        counts = json.loads(f.read() or "{}")
        used = counts.get(point, 0)
        if used >= int(spec.get("times", 1)):
            return None
        counts[point] = used + 1
        f.seek(0)
        f.truncate()
        f.write(json.dumps(counts))
        f.flush()
        os.fsync(f.fileno())
    return dict(spec)


def enabled() -> bool:
    """Whether this process was started with faults to inject (CHARLIE_FAULTS)."""
    return _PATH is not None


def hit(point: str, **context: Any) -> None:
    if _PATH is None:
        return
    spec = _take(point, context)
    if spec is None:
        return
    action = spec.get("action", "raise")
    if action == "kill":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif action == "pause":
        time.sleep(float(spec.get("seconds", 1.0)))
    else:
        raise InjectedFault(f"fault injected at {point}")
