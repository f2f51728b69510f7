"""The benchmark's shared harness: backends, processes, storage, statistics, and the
base of a backend's run (:class:`CellBase`: its workers, its submits and waits, its counters).

Every figure module builds on this one; nothing here measures a figure of its own.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine


SCRIPTS = Path(__file__).resolve().parents[1]
REPO = SCRIPTS.parent
SCENARIOS = (
    "transitions",
    "floor",
    "fanout",
    "recovery",
    "scale",
    "waiting",
    "streaming",
    "console",
    "longrun",
    "limits",
    "inflight",
    "fleet",
    "growth",
)
#: what runs without --only: growth inserts 100,000 tasks, so it is asked for by name
DEFAULT_SCENARIOS = tuple(s for s in SCENARIOS if s != "growth")
#: the long run: turns, each a 4 KiB tool result, and the model's context window (tokens)
LONGRUN_TURNS = 200
LONGRUN_RESULT_BYTES = 4096
LONGRUN_WINDOW = 16_000
PG_ADMIN = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "postgres"}
# BENCH_PG_DATABASE / BENCH_REDIS_DB: another database and Redis db, so that two benchmarks on
# one machine do not wipe each other's
PG_DATABASE = os.environ.get("BENCH_PG_DATABASE", "charlie_bench")
PG_URL = f"postgresql://postgres@127.0.0.1:5432/{PG_DATABASE}"
REDIS_URL = f"redis://127.0.0.1:6379/{os.environ.get('BENCH_REDIS_DB', '14')}"
TOOL = "bench_echo"
RANGE = "\u2013"  # an en dash, between a minimum and a maximum
NONE = "-"
TERMINAL = ("succeeded", "failed", "canceled", "timed_out")


@dataclass(frozen=True)
class Backend:
    name: str
    label: str
    database_url: str | None  # None: SQLite under CHARLIE_HOME
    broker_url: str | None  # None: the embedded broker

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    def env(self, home: Path) -> dict[str, str]:
        env = {"CHARLIE_HOME": str(home)}
        if self.database_url:
            env["CHARLIE_DATABASE_URL"] = self.database_url
        if self.broker_url:
            env["CHARLIE_BROKER_URL"] = self.broker_url
        return env


BACKENDS = {
    "sqlite": Backend("sqlite", "SQLite + embedded broker", None, None),
    "postgres": Backend("postgres", "PostgreSQL + Redis", PG_URL, REDIS_URL),
}


@dataclass(frozen=True)
class Sizes:
    trials: int
    turns_one: int  # T for the single run
    runs_many: int  # concurrent runs
    turns_many: int  # T for each of them
    links_one: int  # links of the single floor chain
    links_many: int  # links of each of the concurrent chains
    fanout_calls: int
    recovery_rounds: int  # each round kills the worker with 2 model calls in flight
    recovery_model_sleep: float  # seconds each scripted model call takes
    scale_tasks: int
    scale_limit: float  # least seconds the drain may take before it is reported unfinished
    waiting_tasks: int  # tasks left waiting for an approval while ordinary runs are measured
    waiting_runs: int  # the batch of ordinary runs measured without and with them waiting
    waiting_turns: int  # T for each run of that batch
    waiting_idle: float  # seconds the workers are watched with only the waiting tasks about
    # an unrecorded batch before the runs without them, and (PostgreSQL) the runs with them
    # measured again after an ANALYZE; not in the smoke run
    waiting_thorough: bool
    console_items: int = 2000  # transcript items of the run the console's task page shows
    console_tasks: int = 100_000  # tasks the console's list pages through
    #: tasks in the tables (queued, waiting, finished) at which growth measures
    growth_levels: tuple[int, ...] = (1_000, 100_000)
    #: turns of the long run (each a 4 KiB result)
    longrun_turns: int = LONGRUN_TURNS
    #: tasks the provider-limits run submits at once
    limits_tasks: int = 200
    #: read PostgreSQL's own commit counts around each measured batch (each read waits out the
    #: backends' stats flush, BENCH_PG_STATS_SETTLE seconds, twice a batch): not in the smoke run
    server_counters: bool = True
    #: the in-flight figure: tasks on the worker as started, tasks on the old default
    #: (prefork, 2 processes: 2 calls in flight), seconds each model call takes, and the
    #: arguments of the first worker (none: `charlie worker` as it starts by default)
    inflight_tasks: int = 1000
    inflight_prefork: int = 60
    inflight_latency: float = 2.0
    inflight_worker_args: str = ""
    #: the DBOS comparison taken in pairs: a Charlie run and a DBOS workflow of the same turns,
    #: alternated this many times a trial (the machine's speed drifts between two far-apart
    #: runs: each pair is taken within a second)
    dbos_pairs: int = 9
    #: the fleet figure: runs at once, turns of each, the worker's arguments
    fleet_runs: int = 50
    fleet_turns: int = 20
    fleet_worker_args: str = ""

    @property
    def recovery_samples(self) -> int:
        return 2 * self.recovery_rounds


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.quick:
        sizes = Sizes(
            args.trials or 1,
            4,
            50,
            1,
            60,
            4,
            100,
            1,
            1.5,
            200,
            60,
            100,
            10,
            1,
            2.0,
            False,
            200,
            2000,
            (1_000, 10_000),
            # a smoke run: long enough for the long run's early and late windows (turns 5-55,
            # the last 50) and for the limiter to queue callers, not for figures
            longrun_turns=60,
            limits_tasks=40,
            server_counters=False,
            inflight_tasks=20,
            inflight_prefork=2,
            fleet_runs=20,
            fleet_turns=2,
            dbos_pairs=2,
        )
    else:
        # The single run and the single floor chain do about the same work (203 transitions,
        # 200 links): on a noisy machine a short trial is one burst of noise. The waiting
        # tasks are watched idle for longer than a stall period plus a sweep (5 s + 1 s), so
        # that a sweep that took them for stalled work would have re-published them.
        sizes = Sizes(
            args.trials or 5, 50, 50, 5, 200, 25, 100, 3, 3.0, 5000, 300, 1000, 50, 5, 7.0, True
        )
    if args.scale_tasks:
        sizes = dataclasses.replace(sizes, scale_tasks=args.scale_tasks)
    if args.waiting_tasks:
        sizes = dataclasses.replace(sizes, waiting_tasks=args.waiting_tasks)
    given = {
        name: getattr(args, name)
        for name in (
            "inflight_tasks",
            "inflight_prefork",
            "inflight_latency",
            "inflight_worker_args",
            "fleet_runs",
            "fleet_turns",
            "fleet_worker_args",
        )
        if getattr(args, name, None) is not None
    }
    return dataclasses.replace(sizes, **given)


class Processes:
    """The child processes of one backend's run, each in its own process group.

    Their group ids are also written to ``pgids`` so that the parent can kill whatever is left
    if this process dies before it can clean up."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        #: the log of each process by name, the latest started
        self.logs: dict[str, Path] = {}
        self.serial = 0
        (home / "logs").mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)

    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        assert name not in self.procs or self.procs[name].poll() is not None, name
        self.serial += 1
        self.logs[name] = self.home / "logs" / f"{name}-{self.serial}.log"
        log = open(self.logs[name], "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv,
            env={**self.env, **(extra_env or {})},
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        with open(self.home / "pgids", "a") as f:
            f.write(f"{proc.pid}\n")

    def pgid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str) -> None:
        """SIGKILL the whole group, as a machine dies."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def close(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for name in list(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            self.kill(name)

    def rss_bytes(self, name: str) -> int:
        """Resident memory of every process in the group, summed (shared pages count twice)."""
        return group_rss(self.pgid(name))


def group_rss(pgid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # the fields after the command, which is in parentheses and may contain spaces
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def kill_groups_listed(path: Path) -> None:
    if not path.exists():
        return
    for line in path.read_text().split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(line), signal.SIGKILL)


def backend_problem(backend: Backend) -> str | None:
    """Why this backend cannot be benchmarked here, or None."""
    if backend.name == "sqlite":
        return None
    try:
        import psycopg2

        psycopg2.connect(connect_timeout=3, **PG_ADMIN).close()
    except Exception as exc:
        return f"PostgreSQL at 127.0.0.1:5432 is not reachable ({str(exc).strip()[:120]})"
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
    except Exception as exc:
        return f"Redis at 127.0.0.1:6379 is not reachable ({str(exc).strip()[:120]})"
    return None


def recreate_pg_database() -> None:
    import psycopg2

    conn = psycopg2.connect(**PG_ADMIN)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{PG_DATABASE}"')
    conn.close()


def drop_pg_database() -> None:
    import psycopg2

    conn = psycopg2.connect(**PG_ADMIN)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)')
    conn.close()


def flush_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ts(value: datetime) -> float:
    return value.timestamp()


@dataclass
class _Progress:
    tag: str = "bench"
    t0: float = field(default_factory=time.monotonic)


_progress = _Progress()


def progress(message: str) -> None:
    """A line on stderr, so a long run shows where it is."""
    elapsed = time.monotonic() - _progress.t0
    print(f"[{_progress.tag} +{elapsed:5.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Results:
    """Raw measurements by metric name: one value per trial (or per sample), plus notes."""

    values: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)


class CellBase:
    """One backend's benchmark: its processes, its database and its measurements.

    The figures are mixins on top of this (``benchmarks.<figure>``); ``benchmarks.runner.Cell``
    puts them together."""

    def __init__(
        self,
        backend: Backend,
        home: Path,
        sizes: Sizes,
        worker_env: dict[str, str],
        dbos_python: str | None = None,
    ):
        from charlie.runtime import get_runtime

        self.dbos_python = dbos_python

        self.backend = backend
        self.home = home
        self.sizes = sizes
        self.results = Results()
        self.stats_dir = home / "stats"
        self.script_dir = home / "scripts"
        self.script_dir.mkdir(parents=True, exist_ok=True)
        self.floor_dir = home / "floor"
        self.floor_dir.mkdir(parents=True, exist_ok=True)
        self.floor_url = (
            f"sqlite:///{self.floor_dir / 'floor.db'}" if backend.name == "sqlite" else PG_URL
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLIE_", "BENCH_"))}
        env.update(backend.env(home))
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH")])
        )
        env["CHARLIE_TOOL_MODULES"] = "_bench_support"
        env["BENCH_STATS_DIR"] = str(self.stats_dir)
        env["BENCH_FLOOR_DATABASE_URL"] = self.floor_url
        env["BENCH_FLOOR_BROKER_DIR"] = str(self.floor_dir / "broker")
        # This process publishes the floor's first links: to the floor's queue directory too.
        os.environ["BENCH_FLOOR_BROKER_DIR"] = env["BENCH_FLOOR_BROKER_DIR"]
        from charlie.models.retry import env_name

        # the long run's model has a window of its own; its twin without one has none
        windowed = f"scripted:{self.script_dir / 'longrun-windowed.json'}"
        env[f"CHARLIE_MODEL_{env_name(windowed.partition(':')[2])}_CONTEXT_TOKENS"] = str(
            LONGRUN_WINDOW
        )
        env.update(worker_env)
        self.procs = Processes(home, env)
        self.rt = get_runtime()
        self.floor_db: Engine | None = None
        self.serial = 0

    def start_worker(self, extra_env: dict[str, str] | None = None) -> None:
        self.serial += 1
        argv = [sys.executable, "-m", "charlie", "worker", "-c", "2", "--pool", "prefork"]
        # --include imports the counters before the pool forks, so that a child counts its
        # first task too (CHARLIE_TOOL_MODULES would import them only inside that task).
        argv += ["-n", f"bench{self.serial}@%h", "--include", "_bench_support"]
        self.procs.spawn("worker", argv, extra_env)

    def wait_ready(self, name: str, timeout: float = 120) -> None:
        """Until the worker's log says it is ready (its slots waiting for messages)."""
        log = self.procs.logs[name]
        deadline = time.monotonic() + timeout
        while " ready." not in log.read_text(errors="replace"):
            if time.monotonic() > deadline or self.procs.procs[name].poll() is not None:
                raise RuntimeError(f"the {name} worker did not start: see {log}")
            time.sleep(0.2)

    def start_beat(self) -> None:
        schedule = self.home / "beat.schedule"
        self.procs.spawn("beat", [sys.executable, "-m", "charlie", "beat", "-s", str(schedule)])

    def script(self, name: str, turns: list[dict[str, Any]], ledger: Path | None = None) -> str:
        path = self.script_dir / f"{name}.json"
        # (a ledger is relative to the script's directory and stays in it)
        doc: Any = {"turns": turns, "ledger": ledger.name} if ledger else turns
        path.write_text(json.dumps(doc))
        return f"scripted:{path}"

    def turns_script(self, turns: int) -> str:
        call = {"tool_calls": [{"id": "c", "name": TOOL, "arguments": {"value": "x"}}]}
        return self.script(f"turns-{turns}", [call] * turns + [{"say": "done"}])

    def submit(
        self, model: str, prefix: str, count: int, approve: list[str] | None = None
    ) -> list[str]:
        from charlie import api

        ids = [f"{prefix}{n:05d}" for n in range(count)]
        for task_id in ids:
            api.submit("bench", model=model, tools=[TOOL], task_id=task_id, approve=approve)
        return ids

    def new_prefix(self, label: str) -> str:
        # no "_" or "%": the prefix is used in LIKE patterns
        return f"{label}.{uuid.uuid4().hex[:8]}."

    def status_counts(self, prefix: str) -> dict[str, int]:
        from sqlalchemy import func, select

        from charlie.store.engine import read
        from charlie.store.schema import tasks

        with read(self.rt.engine) as conn:
            rows = conn.execute(
                select(tasks.c.status, func.count())
                .where(tasks.c.id.like(f"{prefix}%"))
                .group_by(tasks.c.status)
            ).all()
        return {str(r[0]): int(r[1]) for r in rows}

    def wait_done(
        self,
        prefix: str,
        count: int,
        timeout: float,
        on_poll: Callable[[int], None] | None = None,
        every: float = 0.1,
    ) -> None:
        """Poll until ``count`` tasks of ``prefix`` are terminal; fail unless all succeeded.
        (Figures come from the database's timestamps, not from when this notices.)"""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.status_counts(prefix)
            done = sum(counts.get(s, 0) for s in TERMINAL)
            if on_poll is not None:
                on_poll(done)
            if done >= count:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{prefix}: {done}/{count} tasks finished after {timeout:.0f}s")
            time.sleep(every)
        bad = {s: n for s, n in counts.items() if s != "succeeded"}
        if bad:
            raise RuntimeError(f"{prefix}: tasks ended {bad}: {self.first_error(prefix)}")

    def first_error(self, prefix: str) -> Any:
        """The error of one task that ended other than succeeded (the run's, if the task has
        none of its own)."""
        from sqlalchemy import select

        from charlie.store.engine import read
        from charlie.store.schema import executions, tasks

        t, e = tasks.c, executions.c
        with read(self.rt.engine) as conn:
            row = conn.execute(
                select(t.status, t.error, e.error.label("run_error"))
                .select_from(tasks.join(executions, e.task_id == t.id))
                .where(t.id.like(f"{prefix}%"), t.status.in_(TERMINAL), t.status != "succeeded")
                .limit(1)
            ).first()
        return None if row is None else (row.error or row.run_error)

    def transitions(self, prefix: str) -> list[Any]:
        from sqlalchemy import select

        from charlie.store.engine import read
        from charlie.store.schema import transitions

        tr = transitions.c
        with read(self.rt.engine) as conn:
            return list(
                conn.execute(
                    select(tr.execution_id, tr.from_phase, tr.to_phase, tr.at, tr.duration_ms)
                    .where(tr.execution_id.like(f"x-{prefix}%"))
                    .order_by(tr.execution_id, tr.id)
                ).all()
            )

    def first_submit(self, prefix: str) -> float:
        from sqlalchemy import func, select

        from charlie.store.engine import read
        from charlie.store.schema import tasks

        with read(self.rt.engine) as conn:
            first = conn.execute(
                select(func.min(tasks.c.created_at)).where(tasks.c.id.like(f"{prefix}%"))
            ).scalar_one()
        return ts(first)

    def stats(self) -> dict[str, list[int]]:
        """Sum of every worker process's counts: task name -> [tasks, statements]."""
        totals: dict[str, list[int]] = {}
        if not self.stats_dir.exists():
            return totals
        for path in self.stats_dir.glob("*.json"):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            for name, counts in doc["counts"].items():
                entry = totals.setdefault(name, [0, 0, 0])
                for n, value in enumerate(counts[:3]):
                    entry[n] += value
        return totals

    def settled_stats(self) -> dict[str, list[int]]:
        time.sleep(0.6)  # > the workers' flush interval (0.5 s)
        return self.stats()

    @staticmethod
    def stats_delta(
        before: dict[str, list[int]], after: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        out = {}
        for name, counts in after.items():
            earlier = before.get(name, [0, 0, 0])
            diff = [now - then for now, then in zip(counts, earlier, strict=True)]
            if any(diff):
                out[name] = diff
        return out

    @staticmethod
    def loop_commits(delta: dict[str, list[int]]) -> int:
        """The loop's write commits, sweeps left out."""
        return sum(v[2] for k, v in delta.items() if not k.startswith("charlie.sweep."))

    @staticmethod
    def loop_counts(delta: dict[str, list[int]]) -> tuple[int, int, int]:
        """(phase ticks, tool invocations, statements) of the loop, sweeps left out."""
        ticks = sum(v[0] for k, v in delta.items() if k.startswith("charlie.phase."))
        invokes = sum(v[0] for k, v in delta.items() if k == "charlie.tool.invoke")
        statements = sum(v[1] for k, v in delta.items() if not k.startswith("charlie.sweep."))
        return ticks, invokes, statements

    def warm_up(self) -> None:
        prefix = self.new_prefix("warm")
        self.submit(self.turns_script(1), prefix, 4)
        self.wait_done(prefix, 4, timeout=120)

    def charlie_runs(self, runs: int, turns: int, key: str, turn_key: str = "turn.ms") -> float:
        """Run ``runs`` tasks of ``turns`` turns at once; record their rate; return it (and,
        for one run, its median per-turn overhead under ``turn_key``)."""
        model = self.turns_script(turns)
        prefix = self.new_prefix(key)
        server_before = self.pg_counters(PG_DATABASE, settle_first=True)
        before = self.stats()
        self.submit(model, prefix, runs)
        expected = runs * (4 * turns + 3)
        self.wait_done(prefix, runs, timeout=60 + expected * 0.2)
        server_after = self.pg_counters(PG_DATABASE, settle_first=False)
        delta = self.stats_delta(before, self.settled_stats())
        rows = self.transitions(prefix)
        if len(rows) != expected:
            self.results.notes.append(f"{key}: {len(rows)} transitions, expected {expected}")
        wall = self.wall(prefix, rows)
        rate = len(rows) / wall
        self.results.add(f"{key}.tps", rate)
        self.results.add(f"{key}.ms", 1000 / rate)
        ticks, invokes, statements = self.loop_counts(delta)
        self.results.add(f"{key}.tasks_per_transition", (ticks + invokes) / len(rows))
        self.results.add(f"{key}.statements_per_transition", statements / len(rows))
        # Per agent turn: a run's turns, its first load and last report included.
        all_turns = runs * turns
        commits = self.loop_commits(delta)
        self.results.add(f"{key}.turn_wall_ms", wall * 1000 / all_turns)
        self.results.add(f"{key}.commits_per_turn", commits / all_turns)
        self.results.add(f"{key}.statements_per_turn", statements / all_turns)
        if server_before is not None and server_after is not None:
            self.results.add(
                f"{key}.server_commits_per_turn", (server_after[0] - server_before[0]) / all_turns
            )
            self.results.add(
                f"{key}.wal_bytes_per_turn", (server_after[1] - server_before[1]) / all_turns
            )
        message = f"Charlie, {runs} x {turns} turns: {rate:.0f} transitions/s"
        message += f", {commits / all_turns:.2f} commits per turn"
        if runs == 1:
            overheads = turn_overheads(rows)
            self.results.add(turn_key, statistics.median(overheads) * 1000)
            message += f", {statistics.median(overheads) * 1000:.1f} ms per turn"
        progress(message)
        return rate

    def charlie_turn_wall(self, turns: int) -> float:
        """One run of ``turns`` turns, nothing else read around it: its ms per turn, from the
        submit to its last transition (as ``charlie_runs`` takes ``turn_wall_ms``)."""
        prefix = self.new_prefix("pair")
        self.submit(self.turns_script(turns), prefix, 1)
        self.wait_done(prefix, 1, timeout=60 + turns, every=0.02)
        return self.wall(prefix, self.transitions(prefix)) * 1000 / turns

    def wall(self, prefix: str, rows: list[Any]) -> float:
        """Seconds from the first submit of ``prefix`` to the last of its ``rows``' transitions."""
        return max(ts(r.at) for r in rows) - self.first_submit(prefix)

    def pg_counters(self, database: str, *, settle_first: bool) -> tuple[int, int] | None:
        """PostgreSQL's own counts: ``pg_stat_database.xact_commit`` of
        ``database`` (every session on it: the loop, the sweeps, this benchmark's polls) and
        the WAL insert position (``pg_current_wal_insert_lsn``: the whole server, other
        databases included; ``pg_stat_wal.wal_bytes`` counts the same bytes but, like
        ``xact_commit``, only once each backend reports them). A backend reports its counts
        when it goes idle, at most once a second, and an idle one may hold them back for up to
        10 s, so ``xact_commit`` is read only after waiting that out (BENCH_PG_STATS_SETTLE
        seconds, 11 by default): before the WAL position when ``settle_first`` (the start of a
        measurement), after it otherwise (its end)."""
        if self.backend.name != "postgres" or not self.sizes.server_counters:
            return None
        import psycopg

        settle = float(os.environ.get("BENCH_PG_STATS_SETTLE", "11"))
        xact_sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = %s"
        with psycopg.connect(**PG_ADMIN, autocommit=True) as conn:  # type: ignore[arg-type]
            if settle_first:
                time.sleep(settle)
                xact = conn.execute(xact_sql, (database,)).fetchone()
            lsn = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
            if not settle_first:
                time.sleep(settle)
                xact = conn.execute(xact_sql, (database,)).fetchone()
        assert xact is not None and lsn is not None
        return int(xact[0] or 0), int(lsn[0])

    def queue_depth(self) -> int:
        """Messages waiting in Charlie's phase/tool queue on the broker."""
        if self.backend.embedded:
            folder = self.home / "broker" / "queue"
            with os.scandir(folder) as entries:
                return sum(1 for entry in entries if entry.name.endswith(".charlie.msg"))
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        # kombu keeps one list per priority step: "charlie", "charlie\x06\x163", ...
        keys = ["charlie", *(f"charlie\x06\x16{p}" for p in (3, 6, 9))]
        return sum(int(client.llen(k)) for k in keys)

    def analyze(self) -> None:
        """ANALYZE the PostgreSQL database, as autovacuum would."""
        from sqlalchemy import text

        with self.rt.engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            conn.commit()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def turn_overheads(rows: list[Any]) -> list[float]:
    """Model response committed -> next model call's tick started, for each turn of each run."""
    out = []
    by_execution: dict[str, list[Any]] = {}
    for r in rows:
        by_execution.setdefault(r.execution_id, []).append(r)
    for run in by_execution.values():
        model_rows = [r for r in run if r.from_phase == "call_model"]
        for a, b in itertools.pairwise(model_rows):
            if a.to_phase == "dispatch_tools":
                out.append(ts(b.at) - b.duration_ms / 1000 - ts(a.at))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    digits: int = 0
    target: str = ""
    kind: str = "median"  # median | p50 | p95 | all (every trial, in order)
