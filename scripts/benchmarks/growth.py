"""``--only growth`` (asked for by name: it inserts 100,000 tasks): what grows with the tables.

Tasks in the tables, 3/10 queued, 2/10 waiting for an approval, half finished, inserted in
bulk; small = 1,000, large = 100,000 (--quick 10,000): a sweep round, list_tasks, the console's
list, charlie doctor, small against large.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import subprocess
import sys
import time
import uuid
from datetime import datetime
from typing import Any

from benchmarks.harness import Row, free_port, progress

#: growth's figures: (label, key)
GROWTH_FIGURES = (
    ("A sweep round (every sweep once, in-process)", "sweep_ms"),
    ("A sweep round that probes await_tools (once a minute)", "probe_ms"),
    ("list_tasks: first page of 50", "list_ms"),
    ("list_tasks: first page of the waiting", "list_waiting_ms"),
    ("Console: the task list over HTTP", "console_ms"),
    ("charlie doctor: its checks, in-process", "doctor_ms"),
    ("charlie doctor: the command (with Python's start)", "doctor_cli_ms"),
)


class GrowthFigure:
    """The same reads over small and large tables."""

    def growth(self) -> None:
        """Tasks in the tables, queued, waiting and finished, inserted in bulk (no run behind
        them, no worker or beat running): at each size of ``growth_levels``, one sweep round
        (sweeps.sweep_round, as the beat runs it), a list_tasks page, the console's list page
        and `charlie doctor`, and EXPLAIN of every statement they ran, for sequential scans
        of the growing tables. Ratios: the last size's figure over the first's."""
        import httpx

        from charlie import api, doctor, sweeps

        self.procs.kill("worker")
        self.procs.kill("beat")
        levels = self.sizes.growth_levels
        prefix = self.new_prefix("grow")
        token = uuid.uuid4().hex + uuid.uuid4().hex
        port = free_port()
        argv = [sys.executable, "-m", "charlie", "ui", "--port", str(port)]
        self.procs.spawn("console", argv, {"CHARLIE_UI_TOKEN": token})
        base = f"http://127.0.0.1:{port}"
        r = self.results
        trials = max(5, self.sizes.trials)
        inserted = 0
        try:
            with httpx.Client(base_url=base, timeout=120) as http:
                deadline = time.monotonic() + 60
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get("/").status_code == 401:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError("charlie ui did not answer")
                    time.sleep(0.2)
                assert http.get(f"/?token={token}").status_code == 303
                for level in levels:
                    t0 = time.perf_counter()
                    self.growth_insert(prefix, inserted, level)
                    progress(
                        f"growth: {level - inserted:,} tasks inserted in "
                        f"{time.perf_counter() - t0:.1f}s ({level:,} in the tables)"
                    )
                    inserted = level
                    self.analyze()
                    key = "growth.small" if level == levels[0] else "growth.large"
                    with self.statements() as seen:
                        timed = {
                            "sweep_ms": lambda: sweeps.sweep_round(self.rt),
                            "probe_ms": lambda: self.probing_round(sweeps),
                            "list_ms": lambda: api.list_tasks(limit=50),
                            "list_waiting_ms": lambda: api.list_tasks(status="waiting", limit=50),
                            "console_ms": lambda: http.get("/"),
                            "doctor_ms": lambda: doctor.diagnose(timeout=3.0),
                        }
                        for name, work in timed.items():
                            work()  # warm: the first call compiles and caches
                            for _ in range(trials):
                                started = time.perf_counter()
                                work()
                                r.add(f"{key}.{name}", 1000 * (time.perf_counter() - started))
                    # Where a round's time goes: each statement's share, over a few rounds.
                    with self.statement_times() as spent:
                        for _ in range(trials):
                            sweeps.sweep_round(self.rt)
                    r.info[f"{key}.sweep_statements"] = [
                        f"{ms / trials:.1f} ms: {' '.join(text.split())[:80]}"
                        for text, ms in sorted(spent.items(), key=lambda kv: -kv[1])[:4]
                    ]
                    # (a process start each: once in the smoke run)
                    for _ in range(3 if self.sizes.trials > 1 else 1):
                        started = time.perf_counter()
                        done = subprocess.run(
                            [sys.executable, "-m", "charlie", "doctor"],
                            env=self.procs.env,
                            capture_output=True,
                            timeout=120,
                        )
                        r.add(f"{key}.doctor_cli_ms", 1000 * (time.perf_counter() - started))
                    r.info[f"{key}.doctor_exit"] = done.returncode
                    r.info[f"{key}.seq_scans"] = self.seq_scans(seen)
                    progress(
                        f"growth: {level:,} tasks: sweep round "
                        f"{statistics.median(r.values[key + '.sweep_ms']):.1f} ms, list page "
                        f"{statistics.median(r.values[key + '.list_ms']):.1f} ms, console "
                        f"{statistics.median(r.values[key + '.console_ms']):.1f} ms, doctor "
                        f"{statistics.median(r.values[key + '.doctor_ms']):.1f} ms; "
                        f"sequential scans: {r.info[key + '.seq_scans'] or 'none'}"
                    )
        finally:
            self.procs.kill("console")
            self.start_worker()
            self.start_beat()
        r.info["growth.levels"] = list(levels)

    def probing_round(self, sweeps: Any) -> None:
        """A sweep round that also probes the runs in await_tools, as a process's first round
        does and one every CHARLIE_SWEEP_PROBE_SECONDS after it."""
        self.rt.probed_at = None
        sweeps.sweep_round(self.rt)

    def growth_insert(self, prefix: str, start: int, end: int) -> None:
        """Tasks ``start`` to ``end`` of the growth set: 3 in 10 queued (their runs fresh, so
        their ticks stand in the broker and no sweep is due), 2 in 10 waiting for an approval
        (a held call each), half finished (a settled call each); each with its run."""
        from datetime import UTC, timedelta

        from sqlalchemy import insert

        from charlie.domain import execution_id_for
        from charlie.store.engine import write
        from charlie.store.schema import executions, tasks, tool_calls

        now = datetime.now(UTC)
        kinds = ["queued"] * 3 + ["waiting"] * 2 + ["succeeded"] * 4 + ["failed"]
        batch = 5000
        for first in range(start, end, batch):
            rows, runs, calls = [], [], []
            for k in range(first, min(end, first + batch)):
                task_id = f"{prefix}{k:07d}"
                run_id = execution_id_for(task_id)
                created = now - timedelta(seconds=end - k)
                kind = kinds[k % len(kinds)]
                rows.append(
                    {
                        "id": task_id,
                        "prompt": f"growth task {k}: fix the build of service {k % 97}",
                        "model": "scripted:bench.json",
                        "metadata": {},
                        "status": kind,
                        "created_at": created,
                    }
                )
                phase = {"queued": "load_context", "waiting": "await_tools"}.get(kind, "done")
                runs.append(
                    {
                        "id": run_id,
                        "task_id": task_id,
                        "phase": phase,
                        "version": 0 if kind == "queued" else 7,
                        "state": {},
                        "turn": 0 if kind == "queued" else 1,
                        "next_seq": 0 if kind == "queued" else 6,
                        # a queued run is fresh: its tick waits in the broker
                        "updated_at": now + timedelta(days=1) if kind == "queued" else created,
                        "created_at": created,
                    }
                )
                if kind == "queued":
                    continue
                call = {
                    "execution_id": run_id,
                    "call_id": "c0",
                    "turn": 1,
                    "idx": 0,
                    "name": "bench_echo",
                    "arguments": {"value": "x"},
                    "effect": "write",
                    "state": "pending" if kind == "waiting" else "settled",
                }
                # (every row of a bulk insert has the same keys)
                waiting = kind == "waiting"
                call |= {
                    "hold": "approval" if waiting else None,
                    "outcome": None if waiting else "ok",
                    "result": None if waiting else "x",
                    "settled_at": None if waiting else created,
                }
                calls.append(call)
            with write(self.rt.engine) as conn:
                conn.execute(insert(tasks), rows)
                conn.execute(insert(executions), runs)
                if calls:
                    conn.execute(insert(tool_calls), calls)

    @contextlib.contextmanager
    def statements(self) -> Any:
        """The statements this process sends meanwhile, with their parameters."""
        from sqlalchemy import event

        seen: dict[str, Any] = {}

        def record(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            seen.setdefault(statement, params)

        event.listen(self.rt.engine, "before_cursor_execute", record)
        try:
            yield seen
        finally:
            event.remove(self.rt.engine, "before_cursor_execute", record)

    @contextlib.contextmanager
    def statement_times(self) -> Any:
        """Milliseconds this process spends in each statement meanwhile (summed by its text)."""
        from sqlalchemy import event

        spent: dict[str, float] = collections.defaultdict(float)
        started: list[float] = []

        def before(*_: Any) -> None:
            started.append(time.perf_counter())

        def after(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            spent[statement] += 1000 * (time.perf_counter() - started.pop())

        event.listen(self.rt.engine, "before_cursor_execute", before)
        event.listen(self.rt.engine, "after_cursor_execute", after)
        try:
            yield spent
        finally:
            event.remove(self.rt.engine, "before_cursor_execute", before)
            event.remove(self.rt.engine, "after_cursor_execute", after)

    def seq_scans(self, seen: dict[str, Any]) -> list[str]:
        """Which of ``seen``'s reads and writes PostgreSQL plans with a sequential scan of one
        of Charlie's tables: "table: the statement's start" each (EXPLAIN, not run)."""
        if self.backend.name != "postgres":
            return []
        big = {"tasks", "executions", "tool_calls", "transitions", "transcript_items"}
        found: list[str] = []

        def walk(node: dict[str, Any], statement: str) -> None:
            if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") in big:
                head = " ".join(statement.split())[:90]
                found.append(f"{node['Relation Name']}: {head}")
            for child in node.get("Plans", []):
                walk(child, statement)

        with self.rt.engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            for statement, params in seen.items():
                if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH")):
                    continue
                try:
                    with raw.cursor() as cur:
                        cur.execute("EXPLAIN (FORMAT JSON) " + statement, params)
                        (plan,) = cur.fetchone()
                except Exception as exc:  # a statement EXPLAIN cannot take as it was sent
                    raw.rollback()
                    found.append(f"(not explained: {type(exc).__name__}: {statement[:60]})")
                    continue
                raw.rollback()
                walk(plan[0]["Plan"], statement)
        return sorted(set(found))


ROWS: list[Row | str] = [
    "**Growth** (`--only growth`: tasks in the tables, 3/10 queued, 2/10 waiting for an "
    "approval, half finished, inserted in bulk; small = 1,000, large = 100,000, --quick 10,000)",
    *[
        row
        for label, name in GROWTH_FIGURES
        for row in (
            Row(f"{label}, small (ms)", f"growth.small.{name}", 1),
            Row(f"{label}, large (ms)", f"growth.large.{name}", 1),
            Row(f"{label}, large / small", f"growth.ratio.{name}", 2, "≈ 1 (flat)"),
        )
    ],
]
