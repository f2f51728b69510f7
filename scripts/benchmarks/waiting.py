"""``--only waiting``: N tasks waiting for a person (I25).

N tasks (1,000; 100 with --quick) whose first turn calls a tool on their ``approve`` list,
so they wait for a person (I25): the per-turn overhead of 1 run and the rate of a batch of
runs, without and then with the N waiting; meanwhile, what the N hold (leases, started
calls), their transitions, the sweeps' re-publishes and scans, the broker queue. Then every
held call is approved and the N timed to the end.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from benchmarks.harness import TERMINAL, TOOL, Row, progress, ts

if TYPE_CHECKING:
    from benchmarks.runner import Cell


class WaitingFigure:
    """N tasks held for an approval; ordinary runs without and with them waiting."""

    def waiting(self) -> None:
        """N tasks held for an approval, and ordinary runs measured without and with them; then
        every held call approved and the N timed to the end."""
        s, r = self.sizes, self.results
        n = s.waiting_tasks
        # A batch first, not recorded: run alone (--only waiting), the first trial would
        # otherwise measure a cold worker, and only the runs without the N would pay for it.
        if s.waiting_thorough:
            self.charlie_runs(s.waiting_runs, s.waiting_turns, "wait_warm")
            for key in [k for k in r.values if k.startswith("wait_warm.")]:
                del r.values[key]
        scan_ms, _ = self.sweep_scans(None, "base")
        r.add("waiting.scan_base_ms", scan_ms)
        for _ in range(s.trials):
            self.charlie_runs(1, s.turns_one, "wait_base_one", "wait_base_one.turn_ms")
            self.charlie_runs(s.waiting_runs, s.waiting_turns, "wait_base_many")

        # N tasks whose first turn calls a tool on their approve list: held, never dispatched.
        call = {"id": "c", "name": TOOL, "arguments": {"value": "approved"}}
        model = self.script("approve-first", [{"tool_calls": [call]}, {"say": "done"}])
        prefix = self.new_prefix("waiting")
        t0 = time.perf_counter()
        ids = self.submit(model, prefix, n, approve=[TOOL])
        r.add("waiting.submit_per_s", n / (time.perf_counter() - t0))
        self.wait_status(prefix, n, "waiting", timeout=60 + n * 3 * 0.2)
        rows = self.transitions(prefix)
        r.add("waiting.to_waiting_s", max(ts(x.at) for x in rows) - self.first_submit(prefix))
        r.add("waiting.transitions_to_wait", len(rows) / n)
        republished_on_the_way = self.beat_republished(prefix)
        r.add("waiting.republished_on_the_way", republished_on_the_way)
        progress(
            f"waiting: {n} tasks waiting for an approval ({len(rows) / n:.1f} transitions each)"
        )
        # What is still queued then was published while they were on their way (ticks a
        # sweep re-published in the burst, now stale): let it drain before watching them.
        r.add("waiting.queue_reached", self.queue_depth())
        r.add("waiting.queue_drain_s", self.drain_queue(timeout=60 + n * 0.2))
        at_rest = self.held_by(ids)

        # Nothing but the waiting tasks: the workers run nothing for them.
        before = self.settled_stats()
        time.sleep(s.waiting_idle)
        ticks, invokes, _ = self.loop_counts(self.stats_delta(before, self.settled_stats()))
        r.add("waiting.idle_worker_tasks", ticks + invokes)
        r.add("waiting.queue_rest", self.queue_depth())

        # The same ordinary runs, with the N waiting, watched all along.
        watch = HeldWatch(self, ids)
        watch.start()
        try:
            for _ in range(s.trials):
                self.charlie_runs(1, s.turns_one, "wait_with_one", "wait_with_one.turn_ms")
                self.charlie_runs(s.waiting_runs, s.waiting_turns, "wait_with_many")
            scan_ms, scan_rows = self.sweep_scans(prefix)
            r.add("waiting.scan_with_ms", scan_ms)
            if self.backend.name == "postgres":
                # A fresh database has no planner statistics until autovacuum's ANALYZE (none
                # at all on a server running without it): the same once they are there.
                self.analyze()
                scan_ms, more_rows = self.sweep_scans(prefix, "analyzed")
                scan_rows = max(scan_rows, more_rows)
                r.add("waiting.scan_analyzed_ms", scan_ms)
                for _ in range(s.trials if s.waiting_thorough else 0):
                    self.charlie_runs(
                        1, s.turns_one, "wait_analyzed_one", "wait_analyzed_one.turn_ms"
                    )
                    self.charlie_runs(s.waiting_runs, s.waiting_turns, "wait_analyzed_many")
        finally:
            watch.stop()
        after = self.held_by(ids)
        r.add("waiting.scan_rows", scan_rows)
        r.add("waiting.queue_after", self.queue_depth())
        r.add("waiting.samples", watch.samples)
        for name in ("leases", "calls_moved", "not_waiting"):
            r.add(f"waiting.{name}_max", max(watch.most[name], at_rest[name], after[name]))
        r.add("waiting.transitions_while", after["transitions"] - at_rest["transitions"])
        r.add("waiting.swept", after["runs_swept"] + after["calls_swept"])
        r.add("waiting.republished_while", self.beat_republished(prefix) - republished_on_the_way)
        progress(
            f"waiting: {watch.samples} samples, most leases held {watch.most['leases']}, most "
            f"calls moved {watch.most['calls_moved']}, "
            f"{after['transitions'] - at_rest['transitions']} transitions and "
            f"{after['runs_swept'] + after['calls_swept']} sweeps of theirs"
        )
        self.approve_all(prefix, ids)

    def approve_all(self, prefix: str, ids: list[str]) -> None:
        """Approve every held call (found through list_tasks' waiting_for); time the N to the
        end: approvals/s by this producer, and first approve -> last task finished."""
        from charlie import api

        n = len(ids)
        wanted = set(ids)
        held: dict[str, str] = {}
        before: str | None = None
        while True:
            page = api.list_tasks(status="waiting", limit=api.MAX_PAGE, before=before)
            for info in page:
                if info.id in wanted:
                    waits = [w for w in info.waiting_for if w.kind == "approval" and w.tool == TOOL]
                    if len(info.waiting_for) == 1 and waits:
                        held[info.id] = waits[0].call_id
            if len(page) < api.MAX_PAGE:
                break
            before = page[-1].id
        if len(held) != n:
            self.results.notes.append(
                f"waiting: {len(held)} of {n} tasks listed as waiting for one approval of {TOOL}"
            )
        t0 = time.perf_counter()
        for task_id in ids:
            if task_id in held:
                api.approve(task_id, held[task_id], operator="bench")
        self.results.add("waiting.approve_per_s", len(held) / (time.perf_counter() - t0))
        progress(f"waiting: {len(held)} calls approved")
        self.wait_done(prefix, n, timeout=60 + n * 7 * 0.2)
        outcomes = self.call_outcomes(prefix)
        self.results.add("waiting.approved_ok_pct", 100 * outcomes.get("ok", 0) / n)
        self.results.add("waiting.approved_deadline", outcomes.get("deadline_exceeded", 0))
        self.results.add("waiting.started_late", outcomes.get("started_late", 0))
        if set(outcomes) - {"ok", "started_late"}:
            self.results.notes.append(f"waiting: the approved calls settled {outcomes}")
        latencies, first, last = self.approve_latencies(prefix)
        self.results.add("waiting.drain_s", last - first)
        self.results.add("waiting.drain_tasks_per_s", n / (last - first))
        for value in latencies:
            self.results.add("waiting.approve_to_done_s", value)
        progress(f"waiting: approved {n} finished {last - first:.1f}s after the first approve")

    def beat_republished(self, prefix: str) -> int:
        """Ticks of the runs of ``prefix`` that beat's sweeps re-published, from its logs."""
        needle = f"execution_id=x-{prefix}"
        count = 0
        for path in (self.home / "logs").glob("beat-*.log"):
            with open(path, errors="replace") as f:
                count += sum(1 for line in f if "re-published tick" in line and needle in line)
        return count

    def call_outcomes(self, prefix: str) -> dict[str, int]:
        """The outcomes of the calls of ``prefix``'s runs, and how many started past their
        deadline (``started_late``)."""
        from sqlalchemy import func, select

        from charlie.store.engine import read
        from charlie.store.schema import tool_calls

        c = tool_calls.c
        theirs = c.execution_id.like(f"x-{prefix}%")
        with read(self.rt.engine) as conn:
            out = {
                str(row[0]): int(row[1])
                for row in conn.execute(
                    select(c.outcome, func.count()).where(theirs).group_by(c.outcome)
                )
            }
            out["started_late"] = int(
                conn.execute(
                    select(func.count()).where(theirs, c.started_at > c.deadline_at)
                ).scalar_one()
            )
        return out

    def drain_queue(self, timeout: float) -> float:
        """Wait for Charlie's broker queue to be empty; return how long that took."""
        started = time.monotonic()
        while self.queue_depth() > 0:
            if time.monotonic() - started > timeout:
                self.results.notes.append(
                    f"waiting: the broker queue still held {self.queue_depth()} messages "
                    f"after {timeout:.0f} s"
                )
                break
            time.sleep(0.25)
        return time.monotonic() - started

    def wait_status(self, prefix: str, count: int, status: str, timeout: float) -> None:
        """Poll until ``count`` tasks of ``prefix`` have ``status``; fail if one ended."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.status_counts(prefix)
            if counts.get(status, 0) >= count:
                return
            if any(counts.get(t) for t in TERMINAL):
                raise RuntimeError(f"{prefix}: tasks ended {counts}: {self.first_error(prefix)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prefix}: statuses {counts} after {timeout:.0f}s")
            time.sleep(0.25)

    def held_by(self, ids: list[str], watched: bool = False) -> dict[str, int]:
        """What the tasks ``ids`` hold (leases, calls moved past their hold, tasks no longer
        waiting) and, unless ``watched`` (the watch's sample, which must stay cheap), what
        was done to them (transitions, sweeps). By primary key and index: while the runs are
        measured, a scan of the tables would compete with the workers."""
        from sqlalchemy import func, or_, select

        from charlie.store.engine import read
        from charlie.store.schema import executions, tasks, tool_calls, transitions

        e, c, t = executions.c, tool_calls.c, tasks.c
        xids = [f"x-{task_id}" for task_id in ids]
        runs, their_calls = e.id.in_(xids), c.execution_id.in_(xids)
        moved = or_(
            c.state != "pending", c.queued_at.is_not(None), c.started_at.is_not(None),
            c.lease_owner.is_not(None), c.hold.is_(None),
        )  # fmt: skip
        leased = or_(e.lease_owner.is_not(None), e.lease_until.is_not(None))
        queries = {
            "leases": select(func.count()).where(runs, leased),
            "calls_moved": select(func.count()).where(their_calls, moved),
            "not_waiting": select(func.count()).where(t.id.in_(ids), t.status != "waiting"),
        }
        if not watched:
            queries["transitions"] = select(func.count()).where(
                transitions.c.execution_id.in_(xids)
            )
            queries["runs_swept"] = select(func.count()).where(runs, e.swept_at.is_not(None))
            queries["calls_swept"] = select(func.count()).where(
                their_calls, c.swept_at.is_not(None)
            )
        with read(self.rt.engine) as conn:
            return {name: int(conn.execute(q).scalar_one()) for name, q in queries.items()}

    def sweep_scans(
        self, prefix: str | None, label: str = "with", repeats: int = 10
    ) -> tuple[float, int]:
        """Beat's scans for due work, read-only, as one sweep round runs them: the median time
        of a round (ms; the first round, which warms the caches, left out), and how many rows
        they return of the runs of ``prefix``. Each scan's median goes to the info."""
        from datetime import timedelta

        from charlie import sweeps
        from charlie.domain import utcnow
        from charlie.store import calls as call_store
        from charlie.store import scans
        from charlie.store.engine import read

        cfg = self.rt.settings
        stall = timedelta(seconds=cfg.stall_seconds)
        late = timedelta(seconds=cfg.late_watch_seconds)
        limit = sweeps.LIMIT

        def runs(reason: str) -> Callable[[Any, datetime], list[str]]:
            return lambda c, now: [x.id for x in scans.runs_due(c, reason, now, stall, limit)]

        queries = {f"runs_{reason}": runs(reason) for reason in scans.RUN_REASONS}
        queries |= {
            "abandoned_calls": lambda c, now: [
                x.execution_id for x in scans.abandoned_calls(c, now, limit)
            ],
            "overdue_calls": lambda c, now: [
                x.execution_id for x in scans.overdue_calls(c, now, limit)
            ],
            "lost_calls": lambda c, now: [
                x.execution_id for x in scans.lost_calls(c, now, stall, limit)
            ],
            "orphaned_calls": lambda c, now: [
                x.execution_id for x in scans.orphaned_calls(c, now, stall, limit)
            ],
            "overdue_waits": lambda c, now: [
                x.execution_id
                for x in call_store.overdue_waits(c, now - late, now - stall, sweeps.WATCH_LIMIT)
            ],
            "tasks_past_timeout": lambda c, now: [
                f"x-{x}" for x in scans.tasks_past_timeout(c, now, limit)
            ],
        }
        rounds: list[float] = []
        each: dict[str, list[float]] = {name: [] for name in queries}
        found = 0
        for _ in range(repeats + 1):
            now = utcnow()
            rows: list[str] = []
            with read(self.rt.engine) as conn:
                for name, query in queries.items():
                    started = time.perf_counter()
                    rows += query(conn, now)
                    each[name].append(time.perf_counter() - started)
            rounds.append(sum(each[name][-1] for name in queries))
            if prefix is not None:
                found = max(found, sum(1 for x in rows if x.startswith(f"x-{prefix}")))
        self.results.info[f"waiting.scan_{label}_ms_each"] = {
            name: round(statistics.median(times[1:]) * 1000, 2) for name, times in each.items()
        }
        return statistics.median(rounds[1:]) * 1000, found

    def approve_latencies(self, prefix: str) -> tuple[list[float], float, float]:
        """Per task, its approve -> its finish (s); and the first approve and last finish."""
        from sqlalchemy import select

        from charlie.store.engine import read
        from charlie.store.schema import operator_actions, tasks

        a, t = operator_actions.c, tasks.c
        with read(self.rt.engine) as conn:
            rows = conn.execute(
                select(a.at, t.finished_at)
                .select_from(operator_actions.join(tasks, t.id == a.task_id))
                .where(a.task_id.like(f"{prefix}%"), a.action == "approve")
            ).all()
        latencies = [ts(x.finished_at) - ts(x.at) for x in rows]
        return latencies, min(ts(x.at) for x in rows), max(ts(x.finished_at) for x in rows)


class HeldWatch:
    """Samples, on a thread, what the waiting tasks hold while the ordinary runs are measured:
    the most seen of each count of :meth:`Cell.held_by` (its cheap ones)."""

    def __init__(self, cell: Cell, ids: list[str], every: float = 0.5) -> None:
        self.cell, self.ids, self.every = cell, ids, every
        self.most: dict[str, int] = {"leases": 0, "calls_moved": 0, "not_waiting": 0}
        self.samples = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="held-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            try:
                seen = self.cell.held_by(self.ids, watched=True)
            except Exception as exc:  # a busy database: the next sample will do
                self.error = exc
                continue
            self.samples += 1
            for name in self.most:
                self.most[name] = max(self.most[name], seen[name])

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)


ROWS: list[Row | str] = [
    "**Waiting** (N tasks held for an approval; ordinary runs without and with them waiting, "
    "2 worker processes)",
    Row("Producer: submits/s of the N (api.submit, one at a time)", "waiting.submit_per_s"),
    Row("Submit → all N tasks waiting (s)", "waiting.to_waiting_s", 1),
    Row("Transitions per task, up to waiting", "waiting.transitions_to_wait", 1, "3"),
    Row("Broker queue depth when all N were waiting (messages)", "waiting.queue_reached"),
    Row("... drained in (s)", "waiting.queue_drain_s", 1),
    Row("1 run: per-turn overhead, none waiting (ms)", "wait_base_one.turn_ms", 1),
    Row("1 run: per-turn overhead, N waiting (ms)", "wait_with_one.turn_ms", 1),
    Row("Per-turn overhead, N waiting / none", "waiting.turn_ratio", 2, "≈ 1"),
    Row("1 run: per-turn overhead, N waiting, after ANALYZE (ms)", "wait_analyzed_one.turn_ms", 1),
    Row("Per-turn overhead, N waiting after ANALYZE / none", "waiting.turn_ratio_analyzed", 2),
    Row("Batch: transitions/s, none waiting", "wait_base_many.tps"),
    Row("Batch: transitions/s, N waiting", "wait_with_many.tps"),
    Row("Batch transitions/s, N waiting / none", "waiting.tps_ratio", 2, "≈ 1"),
    Row("Batch: transitions/s, N waiting, after ANALYZE", "wait_analyzed_many.tps"),
    Row("Batch transitions/s, N waiting after ANALYZE / none", "waiting.tps_ratio_analyzed", 2),
    Row(
        "Batch: SQL statements per transition, none waiting",
        "wait_base_many.statements_per_transition",
        1,
    ),
    Row(
        "Batch: SQL statements per transition, N waiting",
        "wait_with_many.statements_per_transition",
        1,
    ),
    Row(
        "Batch: Celery tasks per transition, none waiting", "wait_base_many.tasks_per_transition", 2
    ),
    Row("Batch: Celery tasks per transition, N waiting", "wait_with_many.tasks_per_transition", 2),
    Row(
        "Worker tasks run while only the N wait (idle window)", "waiting.idle_worker_tasks", 0, "0"
    ),
    Row("Their runs holding a lease, most seen", "waiting.leases_max", 0, "0"),
    Row("Their calls queued, started or released, most seen", "waiting.calls_moved_max", 0, "0"),
    Row("Their tasks not `waiting`, most seen", "waiting.not_waiting_max", 0, "0"),
    Row("Their transitions while they wait", "waiting.transitions_while", 0, "0"),
    Row(
        "Sweep re-publishes of their ticks on the way to waiting (beat's log)",
        "waiting.republished_on_the_way",
    ),
    Row("Sweep re-publishes of their runs and calls while they wait", "waiting.swept", 0, "0"),
    Row("... of their ticks while they wait (beat's log)", "waiting.republished_while", 0, "0"),
    Row("Rows of theirs the sweeps' scans find due", "waiting.scan_rows", 0, "0"),
    Row("Broker queue depth, N waiting at rest (messages)", "waiting.queue_rest", 0, "0"),
    Row("Broker queue depth, after the runs measured (messages)", "waiting.queue_after", 0, "0"),
    Row("Sweeps' scans, one round, none waiting (ms)", "waiting.scan_base_ms", 1),
    Row("Sweeps' scans, one round, N waiting (ms)", "waiting.scan_with_ms", 1),
    Row("Sweeps' scans, one round, N waiting, after ANALYZE (ms)", "waiting.scan_analyzed_ms", 1),
    Row("Producer: approvals/s (charlie.approve, one at a time)", "waiting.approve_per_s"),
    Row("First approve → all N finished (s)", "waiting.drain_s", 1),
    Row("Approved tasks finished/s", "waiting.drain_tasks_per_s", 1),
    Row("Approve → task finished, p50 (s)", "waiting.approve_to_done_s", 2, "", "p50"),
    Row("Approve → task finished, p95 (s)", "waiting.approve_to_done_s", 2, "", "p95"),
    Row("Approved calls that settled ok (%)", "waiting.approved_ok_pct", 0, "100"),
    Row("... settled deadline_exceeded (calls)", "waiting.approved_deadline", 0, "0"),
    Row("... started past their deadline (calls)", "waiting.started_late", 0, "0"),
]
