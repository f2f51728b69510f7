"""``--sandbox-start N`` (alone: no backend, no worker): the local run_command's start.

what the local ``run_command`` costs before the command does anything: a sandboxed ``true``
run N times through the tool itself (bubblewrap, the allow-list's binds, the environment
set inside), the median in ms; and the same for a task allowed the network (its own
network namespace behind the user-mode stack) where one works here.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import percentile
from benchmarks.table import code_version


def sandbox_start(runs: int) -> int:
    """The local run_command's start time: a sandboxed ``true``, median of ``runs`` (ms), with
    and without the network; the figure the sandbox adds before a command does anything."""
    from charlie.tools.builtins import run_command
    from charlie.tools.context import ToolContext

    command = f"python scripts/bench.py --sandbox-start {runs}"
    print(f"{command}  ({code_version()}, {platform.node()})")
    with tempfile.TemporaryDirectory(prefix="charlie-bench-ws-") as ws:
        for label, metadata in (
            ("no network", {}),
            ("network allowed", {"sandbox": {"network": True}}),
        ):
            ctx = ToolContext(
                task_id="bench",
                execution_id="x-bench",
                call_id="c",
                turn=0,
                workspace=Path(ws),
                metadata=metadata,
                resumed=False,
                handle=None,
                _record_handle=lambda _h: None,
            )
            times: list[float] = []
            try:
                run_command("true", ctx)  # the first pays for probes and caches
                for _ in range(runs):
                    started = time.perf_counter()
                    run_command("true", ctx)
                    times.append((time.perf_counter() - started) * 1000)
            except Exception as exc:
                detail = getattr(exc, "details", None) or {}
                print(f"run_command `true`, {label}: not measured ({exc} {detail})")
                continue
            print(
                f"run_command `true`, {label}: median {statistics.median(times):.1f} ms "
                f"(p10 {percentile(times, 0.1):.1f}, p90 {percentile(times, 0.9):.1f}; "
                f"{runs} runs)"
            )
    return 0
