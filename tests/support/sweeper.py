"""A sweeper process for the two-beats test: runs the real sweeps against a database, at an
agreed instant, with a publisher that records instead of sending; prints what it did as JSON."""

from __future__ import annotations

import json
import sys
import time

from charlie.config import load_settings
from charlie.runtime import Runtime, import_tool_modules
from charlie.store.engine import get_engine
from charlie.sweeps import sweep_stalled_runs, sweep_tool_calls
from charlie.testing import RecordingPublisher
from charlie.tools.registry import REGISTRY


def main() -> None:
    start_at = float(sys.argv[1])
    settings = load_settings()
    import_tool_modules(settings.tool_modules)
    publisher = RecordingPublisher()
    rt = Runtime(
        settings=settings,
        engine=get_engine(settings.database_url),
        worker=f"sweeper-{sys.argv[2]}",
        publisher=publisher,  # type: ignore[arg-type]
        tools=REGISTRY,
    )
    time.sleep(max(0.0, start_at - time.time()))
    stalled = sweep_stalled_runs(rt)
    counts = sweep_tool_calls(rt)
    print(json.dumps({"stalled": stalled, "calls": counts, "sent": publisher.sent}))


if __name__ == "__main__":
    main()
