"""``--only limits``: provider limits the fleet keeps.

provider limits the fleet keeps (CHARLIE_MODEL_LIMITS): a real HTTP server on 127.0.0.1
(``tests/support/fake_openai.py``) that allows 4 requests in flight and 600 a minute and
refuses any more with 429 and retry-after, as OpenAI does; 200 one-call tasks through a
worker of 6 processes with the same limits declared: the provider's refusals, and the
throughput against what the provider allows (4 in flight / its latency, 0.5 s or
``BENCH_LIMITS_LATENCY``: 200 requests stay under the 600 a minute). Then the limiter's
own cost per model call, uncontended, in this process: the statements and milliseconds of
taking and releasing a slot.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

from benchmarks.harness import Row, progress


class LimitsFigure:
    """200 one-call tasks against a provider's limits; the limiter's own cost."""

    def limits(self) -> None:
        from tests.support.fake_openai import (
            FakeOpenAI,
            ProviderLimit,
            Reply,
            chat_text,
            usage_chat,
        )

        # how long the provider takes to answer (BENCH_LIMITS_LATENCY, seconds)
        latency = float(os.environ.get("BENCH_LIMITS_LATENCY", "0.5"))
        concurrency, rpm, n = 4, 600, self.sizes.limits_tasks
        self.results.info["limits.latency_s"] = latency

        def answer(_request: Any) -> Reply:
            return Reply(200, chat_text("done", usage=usage_chat(10, 5)).body)

        limit = ProviderLimit(concurrency, rpm, retry_after="1", latency=latency, answer=answer)
        server = FakeOpenAI().start()
        server.limit = limit
        table = json.dumps({"openai:": {"concurrency": concurrency, "rpm": rpm}})
        env = {
            "CHARLIE_MODEL_BASE_URL": server.url,
            "CHARLIE_MODEL_API_KEY": "bench-key",
            "CHARLIE_MODEL_LIMITS": table,
        }
        self.procs.kill("worker")
        argv = [sys.executable, "-m", "charlie", "worker", "-c", "6", "--pool", "prefork"]
        argv += ["-n", "limits@%h", "--include", "_bench_support"]
        self.procs.spawn("worker", argv, env)
        try:
            prefix = self.new_prefix("limits")
            before = self.settled_stats()
            self.submit("openai:bench-model", prefix, n)
            self.wait_done(prefix, n, timeout=600)
            delta = self.stats_delta(before, self.settled_stats())
        finally:
            self.procs.kill("worker")
            server.stop()
            self.start_worker()
        arrivals = sorted(at for at, _ in limit.admitted)
        allowed = concurrency / latency
        quarters = [
            arrivals[i * len(arrivals) // 4 : (i + 1) * len(arrivals) // 4] for i in range(4)
        ]
        filled = [
            f"{(len(q) - 1) / (q[-1] - q[0]) / allowed:.0%}" if len(q) > 1 and q[-1] > q[0] else "-"
            for q in quarters
        ]
        progress(f"limits: requests/s against the allowed, by quarter of the run: {filled}")
        rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
        self.results.add("limits.refusals", limit.refusals)
        self.results.add("limits.peak", limit.peak)
        self.results.add("limits.rate", rate)
        self.results.add("limits.pct_allowed", 100 * rate / allowed)
        _, _, statements = self.loop_counts(delta)
        self.results.add("limits.statements_per_task", statements / n)
        self.results.add("limits.commits_per_task", self.loop_commits(delta) / n)
        progress(
            f"limits: {n} tasks, {limit.refusals} refusals, peak {limit.peak} in flight, "
            f"{rate:.2f} requests/s of {allowed:g} allowed ({100 * rate / allowed:.0f}%)"
        )
        self.limiter_cost(prefix)

    def limiter_cost(self, prefix: str) -> None:
        """Taking and releasing a slot, uncontended, as a worker does around a model call."""
        from dataclasses import replace as replaced

        from sqlalchemy import event

        from charlie.capacity import FleetLimits
        from charlie.domain import Phase, RunView, TaskStatus, TaskView
        from charlie.limits import parse_limits
        from charlie.models.base import ModelRequest
        from charlie.ports import CapacityWait

        task_id = f"{prefix}00000"
        engine = self.rt.engine
        limits = FleetLimits(
            engine, parse_limits('{"bench:": {"concurrency": 1000}}'), lambda x, v, p: None, 5, 5
        )
        view = RunView(
            execution_id=f"x-{task_id}",
            phase=Phase.CALL_MODEL,
            version=1,
            turn=0,
            state={},
            attempts=1,
            task=TaskView(
                task_id, "bench", "bench:model", None, {}, TaskStatus.RUNNING, None, None
            ),
            now=datetime.now(UTC),
        )
        request = ModelRequest(task_id, view.execution_id, 0, [], [])
        statements = [0]

        def count(*_args: Any) -> None:
            statements[0] += 1

        rounds = 200
        event.listen(engine, "before_cursor_execute", count)
        try:
            started = time.perf_counter()
            for n in range(rounds):
                slot = limits.acquire(replaced(view, version=n), "bench:model", request)
                assert slot is not None and not isinstance(slot, CapacityWait)
                limits.release(slot, None)
            took = time.perf_counter() - started
        finally:
            event.remove(engine, "before_cursor_execute", count)
        self.results.add("limits.cost_ms", 1000 * took / rounds)
        self.results.add("limits.cost_statements", statements[0] / rounds)
        progress(
            f"limiter: {1000 * took / rounds:.2f} ms and {statements[0] / rounds:.1f} "
            "statements per model call (take + release a slot)"
        )


ROWS: list[Row | str] = [
    "**Provider limits** (CHARLIE_MODEL_LIMITS: 200 tasks against 4 in flight, 600/min)",
    Row("Refusals (429) from the provider", "limits.refusals", 0, "0"),
    Row("Most requests in flight at the provider", "limits.peak", 0, "≤ 4"),
    Row("Requests/s", "limits.rate", 2),
    Row("... of what the provider allows (%)", "limits.pct_allowed", 0, "≥ 90"),
    Row(
        "SQL statements per task (one model call, waits included)", "limits.statements_per_task", 1
    ),
    Row("Commits per task (waits included)", "limits.commits_per_task", 1),
    Row("Limiter: ms per model call (take + release, uncontended)", "limits.cost_ms", 2),
    Row("Limiter: SQL statements per model call", "limits.cost_statements", 1),
]
