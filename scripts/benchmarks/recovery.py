"""``--only recovery``: SIGKILL of the worker during model calls.

SIGKILL of the whole worker while model calls are in flight (a scripted model that sleeps),
a new worker started at once; time from the kill to the run moving again (the retried model
call's tick starting), with the default lease and sweep settings and beat running.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks.harness import Row, progress, read_jsonl, ts


class RecoveryFigure:
    """Kill -> run moving again."""

    def recovery(self) -> None:
        ledger = self.script_dir / "recovery-ledger.jsonl"
        sleep = self.sizes.recovery_model_sleep
        model = self.script("recovery", [{"say": "slow answer", "sleep": sleep}], ledger)
        for _ in range(self.sizes.recovery_rounds):
            prefix = self.new_prefix("recovery")
            ids = self.submit(model, prefix, 2)
            deadline = time.monotonic() + 60
            while True:
                started = {e["task_id"] for e in read_jsonl(ledger)} & set(ids)
                if len(started) == len(ids):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("recovery: the model calls did not start")
                time.sleep(0.05)
            time.sleep(random.uniform(0.2, sleep - 0.4))
            killed_at = time.time()
            self.procs.kill("worker")
            self.start_worker()
            self.wait_done(prefix, len(ids), timeout=120)
            by_execution: dict[str, list[Any]] = {}
            for r in self.transitions(prefix):
                by_execution.setdefault(r.execution_id, []).append(r)
            for rows in by_execution.values():
                after = next(r for r in rows if ts(r.at) > killed_at)
                self.results.add("recovery.s", ts(after.at) - after.duration_ms / 1000 - killed_at)
                self.results.add("recovery.next_row_s", ts(after.at) - killed_at)
                progress(f"recovery: moving again {self.results.values['recovery.s'][-1]:.1f}s")
        self.results.info["recovery.model_sleep_s"] = sleep


ROWS: list[Row | str] = [
    "**Recovery** (SIGKILL of the worker during model calls; default lease and sweeps)",
    Row("Kill → run moving again, p50 (s)", "recovery.s", 1, "", "p50"),
    Row("Kill → run moving again, p95 (s)", "recovery.s", 1, "≤ 10 s", "p95"),
    Row(
        "Kill → next transition row, p50 (s) (incl. the retried model call)",
        "recovery.next_row_s",
        1,
        "",
        "p50",
    ),
]
