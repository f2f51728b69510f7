"""``--only scale``: queued tasks drained by a fresh worker.

N queued tasks (one turn each) drained by a fresh worker: transitions/s against the 50-run
figure, the worker's resident memory (sum over its process group), database bytes per task.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
from pathlib import Path

from benchmarks.harness import TERMINAL, Row, progress, ts


class ScaleFigure:
    """N queued tasks of one turn drained by a fresh worker."""

    def db_bytes(self) -> int:
        from sqlalchemy import text

        if self.backend.name == "sqlite":
            path = Path(self.rt.settings.database_url.removeprefix("sqlite:///"))
            db = sqlite3.connect(path, timeout=30)
            try:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                db.close()
            wal = path.with_name(path.name + "-wal")
            return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
        with self.rt.engine.connect() as conn:
            size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        return int(size)

    def scale_time_limit(self, n: int) -> float:
        """Twice the drain time the 50-run rate predicts (7 transitions a task), or 0.2 s a task
        without that figure; never less than the size's floor, never more than 30 minutes. A
        drain that runs away (re-published duplicates) is then reported, not waited for."""
        many = self.results.values.get("many.tps")
        expected = n * 7 / statistics.median(many) if many else n * 0.2
        return min(1800.0, max(self.sizes.scale_limit, 2 * expected))

    def scale(self) -> None:
        n = self.sizes.scale_tasks
        limit = self.scale_time_limit(n)
        model = self.turns_script(1)
        # The idle worker is SIGKILLed rather than stopped: a warm shutdown of an idle worker
        # takes about 7 s on the embedded broker (Celery's synloop), and nothing is in flight.
        self.procs.kill("worker")
        size_before = self.db_bytes()
        prefix = self.new_prefix("scale")
        t0 = time.perf_counter()
        self.submit(model, prefix, n)
        self.results.add("scale.submit_per_s", n / (time.perf_counter() - t0))
        progress(f"scale: {n} tasks queued")
        before = self.settled_stats()
        self.start_worker()
        started = time.monotonic()
        rss_tenth = 0
        depth_max = depth_seen_at = 0.0
        done = 0
        while done < n and time.monotonic() - started < limit:
            time.sleep(1.0)
            counts = self.status_counts(prefix)
            done = sum(counts.get(s, 0) for s in TERMINAL)
            if not rss_tenth and done >= n // 10:
                rss_tenth = self.procs.rss_bytes("worker")
            if time.monotonic() - depth_seen_at >= 5:  # listing a deep queue is not free
                depth_max = max(depth_max, self.queue_depth())
                depth_seen_at = time.monotonic()
        rss_end = self.procs.rss_bytes("worker")
        depth_end = self.queue_depth()
        statuses = self.status_counts(prefix)
        delta = self.stats_delta(before, self.settled_stats())
        rows = self.transitions(prefix)
        times = [ts(r.at) for r in rows]
        window = max(times) - min(times)
        rate = len(rows) / window
        r = self.results
        r.add("scale.finished_pct", 100 * done / n)
        r.add("scale.succeeded_pct", 100 * statuses.get("succeeded", 0) / n)
        if set(statuses) & (set(TERMINAL) - {"succeeded"}):
            r.notes.append(
                f"scale: task statuses {dict(sorted(statuses.items()))}; a failed task's "
                f"error: {json.dumps(self.first_error(prefix), default=str)[:400]}"
            )
        r.add("scale.tps", rate)
        r.add("scale.tasks_per_s", done / window)
        if rss_tenth:
            r.add("scale.rss_tenth_mib", rss_tenth / 2**20)
        r.add("scale.rss_end_mib", rss_end / 2**20)
        r.add("scale.queue_max", max(depth_max, depth_end))
        ticks, invokes, statements = self.loop_counts(delta)
        r.add("scale.tasks_per_transition", (ticks + invokes) / len(rows))
        r.add("scale.statements_per_transition", statements / len(rows))
        r.info["scale.delta"] = delta
        if done == n:
            r.add("scale.bytes_per_task", (self.db_bytes() - size_before) / n)
        else:
            r.notes.append(
                f"scale: {done:,} of {n:,} tasks finished within the {limit:.0f} s limit "
                f"({len(rows):,} transitions); the broker queue then held {depth_end:,} "
                f"messages (max seen {max(depth_max, depth_end):,.0f}); "
                f"{(ticks + invokes) / len(rows):.1f} Celery tasks ran per transition"
            )
        progress(
            f"scale: {done}/{n} finished, {rate:.0f} transitions/s, RSS {rss_end / 2**20:.0f} "
            f"MiB, queue {depth_end} messages"
        )


ROWS: list[Row | str] = [
    "**Scale** (queued tasks of one turn, drained by 2 worker processes)",
    Row("Tasks finished within the time limit (%)", "scale.finished_pct", 0, "100"),
    Row("Tasks succeeded (%)", "scale.succeeded_pct", 0, "100"),
    Row("Transitions/s", "scale.tps"),
    Row("Against the 50-run figure", "scale.vs_many", 2, "≥ 0.85"),
    Row("Tasks/s", "scale.tasks_per_s", 1),
    Row("Celery tasks per transition", "scale.tasks_per_transition", 2),
    Row("Broker queue depth, most seen (messages)", "scale.queue_max"),
]


#: the worker's memory and the database's bytes: printed after the long run's rows, under
#: its heading, where the table has always had them
MEMORY_ROWS: list[Row | str] = [
    Row("Worker RSS after 10% of tasks (MiB)", "scale.rss_tenth_mib"),
    Row("Worker RSS at the end (MiB)", "scale.rss_end_mib", 0, "not growing"),
    Row("Database bytes per finished task", "scale.bytes_per_task"),
    Row("Producer: submits/s (api.submit, one at a time)", "scale.submit_per_s"),
]
