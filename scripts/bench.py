#!/usr/bin/env python
"""Charlie's benchmark: what a transition and a turn cost, side by side with the floor.

    python scripts/bench.py                  # every reachable backend, 3 trials
    python scripts/bench.py --quick          # a smoke run: 1 trial, small sizes
    python scripts/bench.py --backend postgres --only transitions,floor --trials 5

For each backend (SQLite + the embedded broker in a fresh CHARLIE_HOME; PostgreSQL + Redis on
127.0.0.1, database ``charlie_bench`` and Redis db 14, both wiped first), it starts one Charlie
worker (``charlie worker -c 2 --pool prefork``: 2 worker processes) and ``charlie beat`` with
the default settings and measures:

transitions
    scripted tasks of T turns, each turn one instant tool call and an instant model, for 1 run
    and for 50 concurrent runs. A transition is a row of the ``transitions`` table; the rate is
    rows / (last transition - first submit); ms/transition is 1000 / rate (for one run, the
    latency of a transition; for 50, its amortised cost). Per-turn overhead: from the commit of
    a model response (call_model -> dispatch_tools) to the start of the next model call's tick
    (the next call_model transition's time minus its duration).
floor
    a bare Celery chain (``scripts/_bench_floor.py``), in the same run on the same broker and
    database with the same Celery settings, whose every link locks one row, updates it, commits
    and publishes the next link. Charlie / floor compares transitions/s with links/s, trial by
    trial (trials interleave Charlie and floor runs).
fanout
    one turn of 100 instant tool calls: model response to next model call, and SQL statements
    per tool call, counted inside the workers (``scripts/_bench_support.py``).
recovery
    SIGKILL of the whole worker while model calls are in flight (a scripted model that sleeps),
    a new worker started at once; time from the kill to the run moving again (the retried model
    call's tick starting), with the default lease and sweep settings and beat running.
scale
    N queued tasks (one turn each) drained by a fresh worker: transitions/s against the 50-run
    figure, the worker's resident memory (sum over its process group), database bytes per task.
waiting
    N tasks (1,000; 100 with --quick) whose first turn calls a tool on their ``approve`` list,
    so they wait for a person (I25): the per-turn overhead of 1 run and the rate of a batch of
    runs, without and then with the N waiting; meanwhile, what the N hold (leases, started
    calls), their transitions, the sweeps' re-publishes and scans, the broker queue. Then every
    held call is approved and the N timed to the end.
longrun
    one run of 200 turns, each a tool call with a 4 KiB result (800 KiB in all), its scripted
    model given a context window of 16,000 tokens (CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS): the
    largest model input (characters of content / 4, as the model's ledger saw it) against the
    window, the compactions made, and the turn time (call_model's commit to the next one's:
    the input's assembly included) and call_model's own tick, medians over turns 5-55 and
    150-200; then the same run with no window
    (every input the whole transcript), for comparison.
streaming
    what streaming for people watching costs (charlie/streams): one run's per-turn overhead
    with streaming off, to Redis and to a RabbitMQ stream queue (CHARLIE_STREAM_URL; the worker
    restarted for each, trial by trial); and each transport's events/s: 20,000 text deltas of
    24 characters emitted through the writer's sink from one process, in bursts of 1,000 each
    sent before the next, then read back from the first. Redis at BENCH_STREAM_REDIS_URL
    (default the Redis db above), RabbitMQ at BENCH_STREAM_AMQP_URL (default
    amqp://guest:guest@127.0.0.1:5672//); one not reachable is skipped and the table says so.
console
    the run console (``charlie ui``) on a real run of 2,000 transcript items (scripted turns of
    a message and four instant tool calls): the task page's server time over HTTP, its live
    fragment and revision read, and the time to a usable page in headless Chromium (Selenium,
    Debian's chromium + chromium-driver; the load event: the page parsed, styled and its
    script running); then the list's first page, a page deep in it, a status filter and a
    search, over 100,000 tasks inserted directly with SQL.

limits
    provider limits the fleet keeps (CHARLIE_MODEL_LIMITS): a real HTTP server on 127.0.0.1
    (``tests/support/fake_openai.py``) that allows 4 requests in flight and 600 a minute and
    refuses any more with 429 and retry-after, as OpenAI does; 200 one-call tasks through a
    worker of 6 processes with the same limits declared: the provider's refusals, and the
    throughput against what the provider allows (4 in flight / its latency, 0.5 s or
    ``BENCH_LIMITS_LATENCY``: 200 requests stay under the 600 a minute). Then the limiter's
    own cost per model call, uncontended, in this process: the statements and milliseconds of
    taking and releasing a slot.

sandbox start (``--sandbox-start N``, alone: no backend, no worker)
    what the local ``run_command`` costs before the command does anything: a sandboxed ``true``
    run N times through the tool itself (bubblewrap, the allow-list's binds, the environment
    set inside), the median in ms; and the same for a task allowed the network (its own
    network namespace behind the user-mode stack) where one works here.

Each backend runs in a child process of its own (Charlie reads its settings once per process),
one after the other; ``--quick`` is a smoke run whose figures nobody judges, so its backends run
side by side to stay under a minute. ``--dbos-python PYTHON`` (an interpreter with ``dbos``)
adds DBOS on the PostgreSQL round: the same two steps per turn as a DBOS workflow
(``scripts/_bench_dbos.py``). ``--worker-env KEY=VALUE`` runs the workers with a
non-default setting, for experiments (the table then says so). Every process the benchmark
starts runs in its own process group and is killed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine

SCRIPTS = Path(__file__).resolve().parent
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
STREAM_URLS = {
    "redis": os.environ.get("BENCH_STREAM_REDIS_URL", REDIS_URL),
    "rabbitmq": os.environ.get("BENCH_STREAM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
#: text deltas the events/s figure sends through each transport, and each one's text
STREAM_EVENTS = 20_000
STREAM_DELTA = "x" * 24
STREAM_BURST = 1000
TOOL = "bench_echo"
RANGE = "\u2013"  # an en dash, between a minimum and a maximum
NONE = "-"
TERMINAL = ("succeeded", "failed", "canceled", "timed_out")


# --------------------------------------------------------------------------------------------
# Configuration


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
    return sizes


# --------------------------------------------------------------------------------------------
# Processes


class Processes:
    """The child processes of one backend's run, each in its own process group.

    Their group ids are also written to ``pgids`` so that the parent can kill whatever is left
    if this process dies before it can clean up."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.serial = 0
        (home / "logs").mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)

    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        assert name not in self.procs or self.procs[name].poll() is not None, name
        self.serial += 1
        log = open(self.home / "logs" / f"{name}-{self.serial}.log", "ab")  # noqa: SIM115
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


# --------------------------------------------------------------------------------------------
# Reachability and storage


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


# --------------------------------------------------------------------------------------------
# Statistics


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


# --------------------------------------------------------------------------------------------
# One backend's run (the --child process: Charlie reads its settings from this environment)


@dataclass
class Results:
    """Raw measurements by metric name: one value per trial (or per sample), plus notes."""

    values: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)


class Cell:
    """One backend's benchmark: its processes, its database and its measurements."""

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

    # ---- processes

    def start_worker(self, extra_env: dict[str, str] | None = None) -> None:
        self.serial += 1
        argv = [sys.executable, "-m", "charlie", "worker", "-c", "2", "--pool", "prefork"]
        # --include imports the counters before the pool forks, so that a child counts its
        # first task too (CHARLIE_TOOL_MODULES would import them only inside that task).
        argv += ["-n", f"bench{self.serial}@%h", "--include", "_bench_support"]
        self.procs.spawn("worker", argv, extra_env)

    def start_beat(self) -> None:
        schedule = self.home / "beat.schedule"
        self.procs.spawn("beat", [sys.executable, "-m", "charlie", "beat", "-s", str(schedule)])

    def start_floor_worker(self) -> None:
        argv = [sys.executable, "-m", "celery", "-A", "_bench_floor", "worker", "--loglevel"]
        argv += ["INFO", "-Q", "bench_floor", "-c", "2", "--pool", "prefork", "-n", "floor@%h"]
        if self.backend.embedded:
            argv += ["--without-gossip", "--without-mingle"]  # as `charlie worker` does
        self.procs.spawn("floor", argv)

    # ---- scripts and submissions

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

    # ---- reading the outcome from the database

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

    # ---- statement and task counts from inside the workers

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

    # ---- warm-up

    def warm_up(self) -> None:
        prefix = self.new_prefix("warm")
        self.submit(self.turns_script(1), prefix, 4)
        self.wait_done(prefix, 4, timeout=120)

    def warm_up_floor(self) -> None:
        self.floor_chains(4, 3, record=None)

    # ---- 1. transitions

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
        wall = max(ts(r.at) for r in rows) - self.first_submit(prefix)
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

    # ---- streaming for people watching

    def streaming(self) -> None:
        """One run's per-turn overhead with streaming off and on (to each transport reachable),
        the worker restarted for each, interleaved trial by trial; then each transport's
        events/s from this process."""
        reachable = {}
        for name, url in STREAM_URLS.items():
            problem = stream_problem(url)
            if problem:
                self.results.notes.append(f"streaming to {name} not measured: {problem}")
            else:
                reachable[name] = url
        configs = [("off", {"CHARLIE_STREAMING": "0"})] + [
            (name, {"CHARLIE_STREAMING": "1", "CHARLIE_STREAM_URL": url})
            for name, url in reachable.items()
        ]
        try:
            for _ in range(self.sizes.trials):
                for name, env in configs:
                    self.procs.kill("worker")
                    self.start_worker(env)
                    self.warm_up()
                    self.charlie_runs(
                        1, self.sizes.turns_one, f"stream_{name}", f"stream_{name}.turn_ms"
                    )
        finally:
            self.procs.kill("worker")
            self.start_worker()  # the default settings again, for what follows
        for name, url in reachable.items():
            sent, read = stream_rates(url, self.sizes.trials)
            for rate in sent:
                self.results.add(f"stream_{name}.sent_per_s", rate)
            for rate in read:
                self.results.add(f"stream_{name}.read_per_s", rate)
            progress(
                f"{name} stream: {statistics.median(sent):.0f} events/s sent, "
                f"{statistics.median(read):.0f} events/s read"
            )

    # ---- 2. the floor

    def floor_chains(self, chains: int, links: int, record: str | None) -> float:
        import _bench_floor
        from sqlalchemy import text

        eng = self.floor_engine()
        prefix = self.new_prefix(record or "warm")
        ids = [f"{prefix}{n:04d}" for n in range(chains)]
        _bench_floor.start_chains(eng, ids, links)
        deadline = time.monotonic() + 60 + chains * links * 0.2
        table = _bench_floor.TABLE
        while True:
            with eng.connect() as conn:
                row = conn.execute(
                    text(
                        f"SELECT COUNT(done_at), MIN(started_at), MAX(done_at) FROM {table} "
                        "WHERE id LIKE :p"
                    ),
                    {"p": f"{prefix}%"},
                ).one()
            if row[0] >= chains:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"floor: {row[0]}/{chains} chains done")
            time.sleep(0.25)
        rate = float(chains * links / (row[2] - row[1]))
        progress(f"floor, {chains} x {links} links: {rate:.0f} links/s")
        if record:
            self.results.add(f"{record}.tps", rate)
            self.results.add(f"{record}.ms", 1000 / rate)
        return rate

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

    def floor_engine(self) -> Engine:
        import _bench_floor

        if self.floor_db is None:
            self.floor_db = _bench_floor.make_engine(self.floor_url)
            _bench_floor.create_table(self.floor_db)
        return self.floor_db

    def transitions_and_floor(self, with_charlie: bool, with_floor: bool) -> None:
        s = self.sizes
        for _ in range(s.trials):
            c1 = self.charlie_runs(1, s.turns_one, "one") if with_charlie else None
            f1 = self.floor_chains(1, s.links_one, "floor_one") if with_floor else None
            cn = self.charlie_runs(s.runs_many, s.turns_many, "many") if with_charlie else None
            fn = self.floor_chains(s.runs_many, s.links_many, "floor_many") if with_floor else None
            if c1 and f1:
                self.results.add("ratio_one", c1 / f1)
                turn_ms = self.results.values["turn.ms"][-1]
                self.results.add("turn.floor_units", turn_ms / (1000 / f1))
            if cn and fn:
                self.results.add("ratio_many", cn / fn)
            if c1 and self.dbos_python and self.backend.name == "postgres":
                self.dbos_trial()

    def dbos_trial(self) -> None:
        """DBOS on the same PostgreSQL, between Charlie's runs (scripts/_bench_dbos.py)."""
        s = self.sizes
        url = f"{PG_URL}_dbos"
        argv = [str(self.dbos_python), str(SCRIPTS / "_bench_dbos.py"), "--database-url", url]
        argv += ["--turns", str(s.turns_one), "--runs", str(s.runs_many)]
        argv += ["--runs-turns", str(s.turns_many)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
            doc = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError) as exc:
            self.results.notes.append(f"DBOS run failed: {type(exc).__name__}: {exc}")
            return
        self.results.info["dbos"] = doc["version"]
        turn_ms = doc["turn_ms"][0]
        self.results.add("dbos.turn_ms", turn_ms)
        self.results.add("dbos.one_sps", doc["one_steps_s"][0])
        self.results.add("dbos.many_sps", doc["many_steps_s"][0])
        charlie_turn = self.results.values["turn.ms"][-1]
        self.results.add("turn_vs_dbos", charlie_turn / turn_ms)
        self.results.add(
            "whole_turn_vs_dbos", self.results.values["one.turn_wall_ms"][-1] / turn_ms
        )
        # The same figures for DBOS, per turn, 1 workflow and 50 at once.
        for which in ("one", "many"):
            for figure in ("turn_ms", "commits_per_turn", "wal_bytes_per_turn"):
                if doc.get(f"{which}_{figure}"):
                    self.results.add(f"dbos.{which}_{figure}", doc[f"{which}_{figure}"][0])
        ratios = (
            ("many_turn_vs_dbos", "many.turn_wall_ms", "dbos.many_turn_ms"),
            ("one_commits_vs_dbos", "one.commits_per_turn", "dbos.one_commits_per_turn"),
            ("many_commits_vs_dbos", "many.commits_per_turn", "dbos.many_commits_per_turn"),
            ("one_wal_vs_dbos", "one.wal_bytes_per_turn", "dbos.one_wal_bytes_per_turn"),
            ("many_wal_vs_dbos", "many.wal_bytes_per_turn", "dbos.many_wal_bytes_per_turn"),
        )
        for name, ours, theirs in ratios:
            a, b = self.results.values.get(ours), self.results.values.get(theirs)
            if a and b and b[-1]:
                self.results.add(name, a[-1] / b[-1])
        progress(f"DBOS {doc['version']}: {turn_ms:.1f} ms per turn (a model and a tool step)")

    # ---- 3. fan-out

    # ---- long runs: the context window

    def longrun(self) -> None:
        for label in ("windowed", "whole"):
            for _ in range(self.sizes.trials):
                self.longrun_trial(label)

    def longrun_trial(self, label: str) -> None:
        from charlie import api

        turns = self.sizes.longrun_turns
        call = {"name": "bench_page", "arguments": {"size": LONGRUN_RESULT_BYTES}}
        steps = [{"tool_calls": [{**call, "id": f"p{n}"}]} for n in range(turns)]
        ledger = self.script_dir / f"longrun-{label}.jsonl"
        ledger.unlink(missing_ok=True)
        model = self.script(f"longrun-{label}", [*steps, {"say": "done"}], ledger)
        prefix = self.new_prefix(f"longrun-{label}")
        api.submit("bench", model=model, tools=["bench_page"], task_id=f"{prefix}00000")
        self.wait_done(prefix, 1, timeout=900)
        rows = self.transitions(prefix)
        commits = [r for r in rows if r.from_phase == "call_model" and r.to_phase != "call_model"]
        gaps = [ts(b.at) - ts(a.at) for a, b in itertools.pairwise(commits)]
        # 50 turns each (one turn's time is a few ms, noisy on a shared machine)
        early, late = gaps[5:55], gaps[-51:-1]
        key = f"longrun.{label}"
        self.results.add(f"{key}.turn10_ms", statistics.median(early) * 1000)
        self.results.add(f"{key}.turn200_ms", statistics.median(late) * 1000)
        self.results.add(f"{key}.growth", statistics.median(late) / statistics.median(early))
        # call_model's own tick: the input's assembly and the (instant) model call
        ticks = [r.duration_ms for r in commits]
        tick_early, tick_late = statistics.median(ticks[5:55]), statistics.median(ticks[-51:-1])
        self.results.add(f"{key}.tick10_ms", tick_early)
        self.results.add(f"{key}.tick200_ms", tick_late)
        sent = [line.get("input_chars", 0) / 4 for line in read_jsonl(ledger)]
        self.results.add(f"{key}.max_input_tokens", max(sent) if sent else 0)
        items = api.transcript(f"{prefix}00000")
        compactions = sum(1 for i in items if i.kind == "compaction")
        self.results.add(f"{key}.compactions", compactions)
        progress(
            f"long run ({label}): turns 5-55 {statistics.median(early) * 1000:.1f} ms, turns "
            f"150-200 {statistics.median(late) * 1000:.1f} ms (call_model tick {tick_early:.1f} "
            f"-> {tick_late:.1f} ms), largest input {max(sent or [0]):.0f} tokens, "
            f"{compactions} compactions"
        )

    def fanout(self) -> None:
        n = self.sizes.fanout_calls
        calls = [{"id": f"c{i}", "name": TOOL, "arguments": {"value": str(i)}} for i in range(n)]
        model = self.script(f"fanout-{n}", [{"tool_calls": calls}, {"say": "done"}])
        for _ in range(self.sizes.trials):
            prefix = self.new_prefix("fanout")
            before = self.settled_stats()
            self.submit(model, prefix, 1)
            self.wait_done(prefix, 1, timeout=120)
            delta = self.stats_delta(before, self.settled_stats())
            rows = self.transitions(prefix)
            response = next(r for r in rows if r.from_phase == "call_model")
            nxt = [r for r in rows if r.from_phase == "call_model"][1]
            self.results.add("fanout.s", ts(nxt.at) - nxt.duration_ms / 1000 - ts(response.at))
            ticks, _, statements = self.loop_counts(delta)
            invoke_statements = delta.get("charlie.tool.invoke", [0, 0])[1]
            self.results.add("fanout.statements_per_call", statements / n)
            self.results.add("fanout.invoke_statements_per_call", invoke_statements / n)
            self.results.add("fanout.ticks", ticks)
            self.results.info["fanout.last_delta"] = delta
            took = self.results.values["fanout.s"][-1]
            progress(f"fan-out of {n}: {took:.2f}s, {statements / n:.1f} statements per call")
        self.local_fanout()

    def local_fanout(self) -> None:
        """A turn of K = 8 calls (the dispatch batch) of the threadsafe instant tool, which the
        worker that dispatched them runs at once: response to the next model call,
        and a steady such turn's commits (a run of 3 turns less one of 1, over 2)."""
        k = 8
        calls = [{"id": f"c{i}", "name": TOOL, "arguments": {"value": str(i)}} for i in range(k)]
        for _ in range(self.sizes.trials):
            commits, seconds = {}, []
            for turns in (1, 3):
                model = self.script(f"local-{k}-{turns}", [{"tool_calls": calls}] * turns + [
                    {"say": "done"}])  # fmt: skip
                prefix = self.new_prefix("local")
                before = self.settled_stats()
                self.submit(model, prefix, 1)
                self.wait_done(prefix, 1, timeout=120)
                commits[turns] = self.loop_commits(self.stats_delta(before, self.settled_stats()))
                seconds += turn_overheads(self.transitions(prefix))
            self.results.add("fanout_local.ms", statistics.median(seconds) * 1000)
            self.results.add("fanout_local.commits", (commits[3] - commits[1]) / 2)
            progress(
                f"local fan-out of {k}: {statistics.median(seconds) * 1000:.1f} ms, "
                f"{(commits[3] - commits[1]) / 2:.1f} commits per turn"
            )

    # ---- 4. recovery

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

    # ---- limits

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

    # ---- 5. scale

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

    # ---- 6. waiting for a person (I25)

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

    def analyze(self) -> None:
        """ANALYZE the PostgreSQL database, as autovacuum would."""
        from sqlalchemy import text

        with self.rt.engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            conn.commit()

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

    # ---- 7. the run console

    def console(self) -> None:
        import httpx

        items = self.sizes.console_items
        per_turn = 9  # a message, four calls and their four results
        turns = max(1, items // per_turn)
        calls = [
            {"id": f"c{n}", "name": TOOL, "arguments": {"value": f"result {n} " + "x" * 40}}
            for n in range(4)
        ]
        model = self.script(
            "console", [{"say": "step", "tool_calls": calls}] * turns + [{"say": "done"}]
        )
        prefix = self.new_prefix("console")
        (task_id,) = self.submit(model, prefix, 1)
        self.wait_done(prefix, 1, timeout=600)
        from charlie import api

        shown = len(api.transcript(task_id))
        self.results.info["console.items"] = shown
        token = uuid.uuid4().hex + uuid.uuid4().hex
        port = free_port()
        argv = [sys.executable, "-m", "charlie", "ui", "--port", str(port)]
        self.procs.spawn("console", argv, {"CHARLIE_UI_TOKEN": token})
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/", timeout=2).status_code == 401:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("charlie ui did not answer")
            time.sleep(0.2)
        # a page's time is noisy on a shared machine: at least 3 samples, but for the smoke run
        trials = self.sizes.trials if self.sizes.console_items < 1000 else max(3, self.sizes.trials)
        r = self.results
        with httpx.Client(base_url=base, timeout=120) as http:
            assert http.get(f"/?token={token}").status_code == 303
            page = f"/tasks/{task_id}"
            http.get(page)  # the first render compiles the templates
            for _ in range(trials):
                t0 = time.perf_counter()
                body = http.get(page)
                r.add("console.page_ms", 1000 * (time.perf_counter() - t0))
                assert body.status_code == 200
                assert shown <= 300 or 'id="all-rows"' in body.text  # the latest rows only
                r.add("console.page_kib", len(body.content) / 1024)
                t0 = time.perf_counter()
                assert http.get(page + "?all=1").status_code == 200
                r.add("console.page_all_ms", 1000 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                assert http.get(f"/live/tasks/{task_id}").status_code == 200
                r.add("console.fragment_ms", 1000 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                assert http.get(f"/api/tasks/{task_id}/revision").status_code == 200
                r.add("console.revision_ms", 1000 * (time.perf_counter() - t0))
            progress(
                f"console: task page of {shown} items in "
                f"{statistics.median(r.values['console.page_ms']):.0f} ms"
            )
            self.console_browser(base, token, page, trials)
            self.console_list(http, trials)
        self.procs.kill("console")

    def console_browser(self, base: str, token: str, page: str, trials: int) -> None:
        chromium, driver_path = "/usr/bin/chromium", "/usr/bin/chromedriver"
        missing = [p for p in (chromium, driver_path) if not os.path.exists(p)]
        if missing or importlib.util.find_spec("selenium") is None:
            why = f"{', '.join(missing)} missing" if missing else "selenium is not installed"
            self.results.notes.append(f"console: no time in a browser ({why})")
            return
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
            options.add_argument(arg)
        options.add_argument("--window-size=1400,1000")
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            driver.get(f"{base}/?token={token}")
            driver.get(base + page)  # warm: the static files are cached from here on
            timing = "return performance.getEntriesByType('navigation')[0].toJSON()"
            for _ in range(trials):
                driver.get("about:blank")
                t0 = time.perf_counter()
                driver.get(base + page)
                wall = 1000 * (time.perf_counter() - t0)
                nav = driver.execute_script(timing)
                self.results.add("console.browser_load_ms", float(nav["loadEventEnd"]))
                self.results.add("console.browser_dcl_ms", float(nav["domContentLoadedEventEnd"]))
                self.results.add("console.browser_wall_ms", wall)
                driver.get("about:blank")
                driver.get(base + page + "?all=1")
                nav = driver.execute_script(timing)
                self.results.add("console.browser_all_load_ms", float(nav["loadEventEnd"]))
        finally:
            driver.quit()
        progress(
            "console: usable in Chromium after "
            f"{statistics.median(self.results.values['console.browser_load_ms']):.0f} ms"
        )

    def console_list(self, http: Any, trials: int) -> None:
        """The list over many tasks, inserted directly (no run behind them)."""
        from datetime import UTC, timedelta

        from sqlalchemy import insert

        from charlie.domain import execution_id_for
        from charlie.store.engine import write
        from charlie.store.schema import executions, tasks

        n = self.sizes.console_tasks
        now = datetime.now(UTC)
        statuses = ["succeeded"] * 6 + ["failed", "canceled", "waiting", "running"]
        prefix = self.new_prefix("list")
        batch = 5000
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            rows, runs = [], []
            for k in range(start, min(n, start + batch)):
                task_id = f"{prefix}{k:07d}"
                created = now - timedelta(seconds=n - k)
                status = statuses[k % len(statuses)]
                rows.append(
                    {
                        "id": task_id,
                        "prompt": f"benchmark task {k}: fix the build of service {k % 97}",
                        "model": "scripted:bench.json",
                        "metadata": {},
                        "status": status,
                        "created_at": created,
                    }
                )
                runs.append(
                    {
                        "id": execution_id_for(task_id),
                        "task_id": task_id,
                        "phase": "done" if status in TERMINAL else "await_tools",
                        "version": 7,
                        "state": {},
                        "turn": 1,
                        "next_seq": 6,
                        "updated_at": created,
                        "created_at": created,
                    }
                )
            with write(self.rt.engine) as conn:
                conn.execute(insert(tasks), rows)
                conn.execute(insert(executions), runs)
        progress(f"console: {n:,} tasks inserted in {time.perf_counter() - t0:.1f}s")
        deep = f"{prefix}{n // 2:07d}"
        pages = {
            "console.list_first_ms": "/",
            "console.list_deep_ms": f"/?before={deep}",
            "console.list_status_ms": "/?status=failed",
            "console.list_search_ms": f"/?q=service+{n % 97}",
        }
        for key, path in pages.items():
            assert http.get(path).status_code == 200
            for _ in range(trials):
                t0 = time.perf_counter()
                assert http.get(path).status_code == 200
                self.results.add(key, 1000 * (time.perf_counter() - t0))
        self.results.info["console.tasks"] = n
        progress(
            f"console: a list page over {n:,} tasks in "
            f"{statistics.median(self.results.values['console.list_first_ms']):.0f} ms"
        )

    # ---- growth

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


def stream_problem(url: str) -> str | None:
    """Why the transport at ``url`` cannot be used here, or None."""
    from charlie.streams.open import open_transport

    transport = open_transport(url, ttl=600, max_events=STREAM_EVENTS * 2)
    try:
        transport.append(f"bench-probe-{uuid.uuid4().hex[:8]}", [{"type": "probe"}])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        transport.close()
    return None


def stream_rates(url: str, trials: int) -> tuple[list[float], list[float]]:
    """Events/s through the transport at ``url``, trial by trial: STREAM_EVENTS text deltas
    emitted through the writer's sink (charlie.streams.sink.TaskEvents, its writer thread
    batching them) until flushed; then read back from the first event, as a late reader."""
    from charlie.streams.open import open_transport
    from charlie.streams.sink import TaskEvents

    sent: list[float] = []
    read: list[float] = []
    for _ in range(trials):
        transport = open_transport(url, ttl=600, max_events=STREAM_EVENTS * 2)
        sink = TaskEvents(transport)
        task_id = f"bench-stream-{uuid.uuid4().hex[:8]}"
        try:
            sink.emit(task_id, "model_start", turn=0, call="0.0.1")
            if not sink.flush(60):
                raise RuntimeError(f"the first event was not sent to {url} within 60 s")
            started = time.perf_counter()
            # in bursts the sink keeps whole (past MAX_QUEUED waiting, it drops deltas), each
            # waited for: what a fast model's stream asks of it, over and over
            for burst in range(0, STREAM_EVENTS, STREAM_BURST):
                for _ in range(min(STREAM_BURST, STREAM_EVENTS - burst)):
                    sink.emit(task_id, "text", turn=0, call="0.0.1", text=STREAM_DELTA)
                if not sink.flush(600):
                    raise RuntimeError(f"{STREAM_EVENTS} events not sent to {url} within 600 s")
            sent.append(STREAM_EVENTS / (time.perf_counter() - started))
            got = 0
            offset = None
            started = time.perf_counter()
            while got < STREAM_EVENTS + 1:
                batch = transport.read(task_id, offset, 5.0)
                if not batch:
                    raise RuntimeError(f"read {got} of {STREAM_EVENTS + 1} events back from {url}")
                got += len(batch)
                offset = batch[-1].offset
            read.append(got / (time.perf_counter() - started))
        finally:
            transport.close()
    return sent, read


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def run_backend(backend: Backend, args: argparse.Namespace, result_path: Path) -> None:
    """The --child process: set up the storage, start the cluster, measure, write results."""
    _progress.tag = backend.name
    home = Path(os.environ["CHARLIE_HOME"])
    sizes = sizes_for(args)
    only = set(args.only)
    worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
    os.environ.update(worker_env)  # the producer (this process) runs with the workers' settings
    if backend.name == "postgres":
        recreate_pg_database()
        flush_redis()
        from charlie.store.engine import upgrade

        upgrade(PG_URL)
    cell = Cell(backend, home, sizes, worker_env, dbos_python(args))
    cfg = cell.rt.settings
    described = (
        f"lease {cfg.lease_seconds:g} s, sweep every {cfg.sweep_interval:g} s, stall "
        f"{cfg.stall_seconds:g} s, dispatch batch {cfg.dispatch_batch}, inline steps "
        f"{cfg.inline_phases}, task events {'on' if cfg.task_events else 'off'}"
    )
    if backend.embedded:
        described += f", embedded broker polling every {cfg.embedded_poll_interval * 1000:g} ms"
    cell.results.info["settings"] = described
    if backend.name == "postgres":
        autovacuum = pg_setting("autovacuum")
        if autovacuum != "on":
            cell.results.notes.append(
                f"the PostgreSQL server runs with autovacuum {autovacuum}: the benchmark's "
                "fresh database has no planner statistics but where it runs ANALYZE itself"
            )
    steps: dict[str, Callable[[], None]] = {}
    if only & {"transitions", "floor"}:
        with_charlie, with_floor = "transitions" in only, "floor" in only
        steps["transitions+floor"] = lambda: cell.transitions_and_floor(with_charlie, with_floor)
    # every scenario but the two run together above is a Cell method of its own name
    steps.update({name: getattr(cell, name) for name in SCENARIOS[2:]})
    failed = False
    try:
        cell.start_worker()
        cell.start_beat()
        if "floor" in only:
            cell.start_floor_worker()
        cell.warm_up()
        if "floor" in only:
            cell.warm_up_floor()
        progress("workers up and warm")
        for name, step in steps.items():
            if name not in only and name != "transitions+floor":
                continue
            started = time.perf_counter()
            try:
                step()
            except Exception as exc:
                failed = True
                cell.results.notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
                progress(f"{name} FAILED: {exc}")
                if "worker" not in cell.procs.procs:
                    cell.start_worker()
            cell.procs.kill("floor")  # the floor is measured only alongside the transitions
            progress(f"{name} took {time.perf_counter() - started:.1f}s")
    except BaseException as exc:
        failed = True
        cell.results.notes.append(f"stopped: {type(exc).__name__}: {exc}")
        raise
    finally:
        cell.procs.close()
        cell.rt.engine.dispose()
        if cell.floor_db is not None:
            cell.floor_db.dispose()
        cell.results.info["versions"] = server_versions(backend)
        if backend.name == "postgres" and not args.keep:
            with contextlib.suppress(Exception):
                drop_pg_database()
            with contextlib.suppress(Exception):
                flush_redis()
        doc = {
            "values": cell.results.values,
            "notes": cell.results.notes,
            "info": cell.results.info,
            "failed": failed,
        }
        result_path.write_text(json.dumps(doc, default=str))


def pg_setting(name: str) -> str:
    import psycopg2

    conn = psycopg2.connect(**PG_ADMIN)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SHOW {name}")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


def server_versions(backend: Backend) -> dict[str, str]:
    out = {"sqlite": sqlite3.sqlite_version}
    if backend.name != "postgres":
        return out
    with contextlib.suppress(Exception):
        import psycopg2

        conn = psycopg2.connect(**PG_ADMIN)
        with conn.cursor() as cur:
            cur.execute("SHOW server_version")
            out["postgresql"] = str(cur.fetchone()[0])
        conn.close()
    with contextlib.suppress(Exception):
        import redis

        out["redis"] = str(redis.Redis.from_url(REDIS_URL).info("server")["redis_version"])
    return out


# --------------------------------------------------------------------------------------------
# The parent: one child per backend, then the table


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    digits: int = 0
    target: str = ""
    kind: str = "median"  # median | p50 | p95 | all (every trial, in order)


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

ROWS: list[Row | str] = [
    "**Transitions** (scripted tasks: each turn one instant tool call and an instant model)",
    Row("Charlie, 1 run: transitions/s", "one.tps"),
    Row("Charlie, 1 run: ms per transition", "one.ms", 1),
    Row("Floor, 1 chain: links/s", "floor_one.tps"),
    Row("Floor, 1 chain: ms per link", "floor_one.ms", 1),
    Row("Charlie / floor, 1 run", "ratio_one", 2, "≥ 0.80"),
    Row("Charlie, 50 runs: transitions/s", "many.tps"),
    Row("Charlie, 50 runs: ms per transition (1000 / rate)", "many.ms", 1),
    Row("Floor, 50 chains: links/s", "floor_many.tps"),
    Row("Charlie / floor, 50 runs", "ratio_many", 2, "≥ 0.80"),
    Row("Celery tasks per transition, 50 runs", "many.tasks_per_transition", 2),
    Row("SQL statements per transition, 50 runs", "many.statements_per_transition", 1),
    Row("Per-turn overhead: model response → next model call (ms)", "turn.ms", 1),
    Row("Per-turn overhead, in floor transitions", "turn.floor_units", 1, "≤ 4"),
    "**Per turn** (a run's turns, its first load and last report spread over them)",
    Row("Charlie, 1 run: ms per turn (wall / turns)", "one.turn_wall_ms", 1),
    Row("Charlie, 50 runs: ms per turn (wall / all turns)", "many.turn_wall_ms", 2),
    Row("Commits per turn, 1 run (in the workers)", "one.commits_per_turn", 2, "≤ 3"),
    Row("Commits per turn, 50 runs (in the workers)", "many.commits_per_turn", 2, "≤ 3"),
    Row(
        "Commits per turn, 1 run (server: xact_commit, sweeps and polls too)",
        "one.server_commits_per_turn",
        1,
    ),
    Row("Commits per turn, 50 runs (server)", "many.server_commits_per_turn", 1),
    Row("WAL bytes per turn, 1 run (whole server)", "one.wal_bytes_per_turn"),
    Row("WAL bytes per turn, 50 runs (whole server)", "many.wal_bytes_per_turn"),
    Row("SQL statements per turn, 1 run", "one.statements_per_turn", 1),
    Row("SQL statements per turn, 50 runs", "many.statements_per_turn", 1),
    "**DBOS** (optional: each turn a model step and a tool step as a DBOS workflow, same database)",
    Row("DBOS, 1 workflow: ms per turn", "dbos.turn_ms", 1),
    Row("Charlie per-turn overhead / DBOS per turn", "turn_vs_dbos", 2, "< 1 (stretch)"),
    Row("Charlie whole turn (wall / turns) / DBOS per turn", "whole_turn_vs_dbos", 2, "≤ 1.5"),
    Row("... trial by trial", "whole_turn_vs_dbos", 2, "", "all"),
    Row("... per-turn overhead / DBOS per turn, trial by trial", "turn_vs_dbos", 2, "", "all"),
    Row("DBOS, 50 workflows: ms per turn (wall / all turns)", "dbos.many_turn_ms", 2),
    Row("Charlie 50 runs / DBOS 50 workflows, per turn", "many_turn_vs_dbos", 2),
    Row("... trial by trial", "many_turn_vs_dbos", 2, "", "all"),
    Row("DBOS commits per turn, 1 workflow (in its process)", "dbos.one_commits_per_turn", 2),
    Row("DBOS commits per turn, 50 workflows", "dbos.many_commits_per_turn", 2),
    Row("Charlie / DBOS commits per turn, 1 / 50", "one_commits_vs_dbos", 2),
    Row("... 50 runs / 50 workflows", "many_commits_vs_dbos", 2),
    Row("DBOS WAL bytes per turn, 1 workflow", "dbos.one_wal_bytes_per_turn"),
    Row("DBOS WAL bytes per turn, 50 workflows", "dbos.many_wal_bytes_per_turn"),
    Row("Charlie / DBOS WAL bytes per turn, 1 / 50", "one_wal_vs_dbos", 2),
    Row("... 50 runs / 50 workflows", "many_wal_vs_dbos", 2),
    Row("DBOS, 1 workflow: steps/s", "dbos.one_sps"),
    Row("DBOS, 50 workflows: steps/s", "dbos.many_sps"),
    "**Fan-out** (one turn of 100 instant tool calls)",
    Row("Model response → next model call (s)", "fanout.s", 2, "≤ 3 s"),
    Row("SQL statements per tool call (whole turn)", "fanout.statements_per_call", 1, "bounded"),
    Row("SQL statements per tool invocation task", "fanout.invoke_statements_per_call", 1),
    Row(
        "A turn of 8 threadsafe calls, run at once by its worker: response → next model call (ms)",
        "fanout_local.ms",
        1,
    ),
    Row("... its commits (a steady turn)", "fanout_local.commits", 1, "≤ K + 2 = 10"),
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
    "**Scale** (queued tasks of one turn, drained by 2 worker processes)",
    Row("Tasks finished within the time limit (%)", "scale.finished_pct", 0, "100"),
    Row("Tasks succeeded (%)", "scale.succeeded_pct", 0, "100"),
    Row("Transitions/s", "scale.tps"),
    Row("Against the 50-run figure", "scale.vs_many", 2, "≥ 0.85"),
    Row("Tasks/s", "scale.tasks_per_s", 1),
    Row("Celery tasks per transition", "scale.tasks_per_transition", 2),
    Row("Broker queue depth, most seen (messages)", "scale.queue_max"),
    "**Long run** (200 turns of 4 KiB results, 800 KiB in all; a 16,000-token window, then none)",
    Row("Windowed: turn time, turns 5-55 (ms, median)", "longrun.windowed.turn10_ms", 1),
    Row("Windowed: turn time, turns 150-200 (ms, median)", "longrun.windowed.turn200_ms", 1),
    Row("Windowed: late / early turn time", "longrun.windowed.growth", 2, "≤ 1.20"),
    Row("Windowed: call_model tick, turns 5-55 (ms)", "longrun.windowed.tick10_ms", 1),
    Row("Windowed: call_model tick, turns 150-200 (ms)", "longrun.windowed.tick200_ms", 1),
    Row("Windowed: largest model input (tokens, chars/4)", "longrun.windowed.max_input_tokens"),
    Row("Windowed: compactions", "longrun.windowed.compactions"),
    Row("No window: turn time, turns 5-55 (ms, median)", "longrun.whole.turn10_ms", 1),
    Row("No window: turn time, turns 150-200 (ms, median)", "longrun.whole.turn200_ms", 1),
    Row("No window: late / early turn time", "longrun.whole.growth", 2),
    Row("No window: call_model tick, turns 5-55 (ms)", "longrun.whole.tick10_ms", 1),
    Row("No window: call_model tick, turns 150-200 (ms)", "longrun.whole.tick200_ms", 1),
    Row("No window: largest model input (tokens, chars/4)", "longrun.whole.max_input_tokens"),
    Row("Worker RSS after 10% of tasks (MiB)", "scale.rss_tenth_mib"),
    Row("Worker RSS at the end (MiB)", "scale.rss_end_mib", 0, "not growing"),
    Row("Database bytes per finished task", "scale.bytes_per_task"),
    Row("Producer: submits/s (api.submit, one at a time)", "scale.submit_per_s"),
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
    "**Streaming** (events for people watching: 1 run's per-turn overhead with streaming off "
    "and on, the worker restarted for each; events/s of each transport from one process)",
    Row("1 run: per-turn overhead, streaming off (ms)", "stream_off.turn_ms", 1),
    Row("1 run: per-turn overhead, streaming to Redis (ms)", "stream_redis.turn_ms", 1),
    Row("1 run: per-turn overhead, streaming to RabbitMQ (ms)", "stream_rabbitmq.turn_ms", 1),
    Row("Per-turn overhead, Redis streaming / off", "stream_redis.turn_ratio", 2, "≈ 1"),
    Row("Per-turn overhead, RabbitMQ streaming / off", "stream_rabbitmq.turn_ratio", 2, "≈ 1"),
    Row("1 run: ms per turn (wall / turns), streaming off", "stream_off.turn_wall_ms", 1),
    Row("... streaming to Redis", "stream_redis.turn_wall_ms", 1),
    Row("... streaming to RabbitMQ", "stream_rabbitmq.turn_wall_ms", 1),
    Row("Redis: events/s sent (text deltas through the sink)", "stream_redis.sent_per_s"),
    Row("Redis: events/s read back (a late reader)", "stream_redis.read_per_s"),
    Row("RabbitMQ: events/s sent (text deltas through the sink)", "stream_rabbitmq.sent_per_s"),
    Row("RabbitMQ: events/s read back (a late reader)", "stream_rabbitmq.read_per_s"),
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
    "**Console** (`charlie ui`: one run's page, the task list; sizes above)",
    Row("Task page (the latest 300 rows): server time over HTTP (ms)", "console.page_ms"),
    Row("Task page: size (KiB)", "console.page_kib"),
    Row("Task page with every row (?all=1): server time (ms)", "console.page_all_ms"),
    Row("Task page: its live fragment (ms)", "console.fragment_ms"),
    Row("Task page: the revision poll (ms)", "console.revision_ms", 1),
    Row("Task page in Chromium: usable (load event, ms)", "console.browser_load_ms"),
    Row("Task page in Chromium: DOM ready (ms)", "console.browser_dcl_ms"),
    Row("Task page with every row in Chromium: usable (ms)", "console.browser_all_load_ms"),
    Row("List: first page (ms)", "console.list_first_ms", 1),
    Row("List: a page halfway down (ms)", "console.list_deep_ms", 1),
    Row("List: a status filter's first page (ms)", "console.list_status_ms", 1),
    Row("List: a search's first page (ms)", "console.list_search_ms", 1),
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


def cell_text(values: list[float] | None, row: Row) -> str:
    if not values:
        return NONE
    if row.kind == "all":
        return " / ".join(f"{v:,.{row.digits}f}" for v in values)
    if row.kind in ("p50", "p95"):
        v = percentile(values, 0.5 if row.kind == "p50" else 0.95)
        return f"{v:.{row.digits}f} (n={len(values)})"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:,.{row.digits}f}"
    d = row.digits
    return f"{mid:,.{d}f} ({min(values):,.{d}f}{RANGE}{max(values):,.{d}f})"


def derive(values: dict[str, list[float]]) -> None:
    for _, name in GROWTH_FIGURES:
        small, large = values.get(f"growth.small.{name}"), values.get(f"growth.large.{name}")
        if small and large:
            values[f"growth.ratio.{name}"] = [statistics.median(large) / statistics.median(small)]
    many = values.get("many.tps")
    if many and values.get("scale.tps"):
        values["scale.vs_many"] = [v / statistics.median(many) for v in values["scale.tps"]]
    # Waiting: the runs without the N waiting are all measured before they are submitted, so
    # the ratios are of the medians, not trial by trial.
    for ratio, base, held in (
        ("waiting.turn_ratio", "wait_base_one.turn_ms", "wait_with_one.turn_ms"),
        ("waiting.tps_ratio", "wait_base_many.tps", "wait_with_many.tps"),
        ("waiting.turn_ratio_analyzed", "wait_base_one.turn_ms", "wait_analyzed_one.turn_ms"),
        ("waiting.tps_ratio_analyzed", "wait_base_many.tps", "wait_analyzed_many.tps"),
    ):
        if values.get(base) and values.get(held):
            values[ratio] = [statistics.median(values[held]) / statistics.median(values[base])]
    # Streaming: off and on interleave trial by trial, so the ratios are too.
    off = values.get("stream_off.turn_ms")
    for name in STREAM_URLS:
        on = values.get(f"stream_{name}.turn_ms")
        if off and on:
            values[f"stream_{name}.turn_ratio"] = [b / a for a, b in zip(off, on, strict=False)]


def render(
    results: dict[str, dict[str, Any]],
    labels: dict[str, str],
    skipped: dict[str, str],
    command: str,
    sizes: Sizes,
    worker_env: list[str],
    version: str,
) -> str:
    names = list(results)
    out = [f"Command: `{command}`  ", f"Charlie: {version}  ", machine_line(results), ""]
    out.append(
        f"Trials: {sizes.trials} (median, min{RANGE}max); 1 run of {sizes.turns_one} turns; "
        f"{sizes.runs_many} runs of {sizes.turns_many} turns; floor chains of {sizes.links_one} "
        f"and {sizes.runs_many} x {sizes.links_many} links; fan-out of {sizes.fanout_calls}; "
        f"{sizes.recovery_samples} recovery samples; scale {sizes.scale_tasks:,} tasks; "
        f"N = {sizes.waiting_tasks:,} waiting tasks, batch of {sizes.waiting_runs} runs of "
        f"{sizes.waiting_turns} turns; console: a run of about {sizes.console_items:,} "
        f"transcript items, a list over {sizes.console_tasks:,} tasks."
    )
    out.append("")
    if names:
        out.append("| Metric | " + " | ".join(labels[n] for n in names) + " | Target |")
        out.append("|---|" + "---:|" * len(names) + "---|")
        heading = ""
        for row in ROWS:
            if isinstance(row, str):
                heading = f"| {row} |" + " |" * len(names) + " |"
                continue
            cells = [cell_text(results[n]["values"].get(row.key), row) for n in names]
            if all(c == NONE for c in cells):
                continue
            if heading:  # a section's heading, once it has a row to show
                out.append(heading)
                heading = ""
            out.append(f"| {row.label} | " + " | ".join(cells) + f" | {row.target} |")
    out.append("")
    out += FOOTNOTES
    for name in names:
        if "settings" in results[name]["info"]:
            out.append(f"- {labels[name]}: Charlie ran with {results[name]['info']['settings']}.")
    if worker_env:
        out.append(f"- Not the default configuration: workers ran with {' '.join(worker_env)}.")
    for name, reason in skipped.items():
        out.append(f"- {labels[name]}: skipped: {reason}")
    measured = [results[n]["info"]["dbos"] for n in names if "dbos" in results[n]["info"]]
    if measured:
        out.append(
            f"- DBOS {measured[0]}: one workflow per run, its steps returning at once; DBOS runs "
            "in the benchmark's process (no broker, no worker pool), checkpointing each step "
            "in PostgreSQL. Per turn: the workflow's time / its turns."
        )
    else:
        out.append(
            "- DBOS: not measured (`--dbos-python` names an interpreter with `pip install dbos`, "
            "or install it here); skipped."
        )
    for name in names:
        for note in results[name]["notes"]:
            out.append(f"- {labels[name]}: {note}")
        info = results[name]["info"]
        for size in ("small", "large"):
            if f"growth.{size}.seq_scans" in info:
                scans = info[f"growth.{size}.seq_scans"]
                out.append(
                    f"- {labels[name]}: growth, {size}: sequential scans of Charlie's tables in "
                    "the plans (EXPLAIN) of the statements measured: "
                    + ("; ".join(scans) if scans else "none")
                    + f"; `charlie doctor` exited {info.get(f'growth.{size}.doctor_exit')}"
                )
            if info.get(f"growth.{size}.sweep_statements"):
                out.append(
                    f"- {labels[name]}: growth, {size}: a sweep round's costliest statements "
                    "(ms a round): " + "; ".join(info[f"growth.{size}.sweep_statements"])
                )
    return "\n".join(out)


FOOTNOTES = [
    "- Targets are the project's, for PostgreSQL + Redis with 2 worker processes.",
    "- A transition is a row of Charlie's `transitions` table (a turn is 4: call_model, "
    "dispatch_tools, await_tools, advance_turn); a floor link locks, updates and commits one "
    "row and publishes the next link. Ratios are taken trial by trial.",
    "- Per-turn overhead and fan-out: from the commit of the model's response to the start of "
    "the next model call's tick (its transition time minus its duration).",
    "- SQL statements are counted inside the workers with a `before_cursor_execute` listener: "
    "on SQLite they include `BEGIN IMMEDIATE`/`DEFERRED`; on PostgreSQL BEGIN and COMMIT are not"
    " statements. Sweeps are left out.",
    "- Recovery: the worker (main process and pool) is SIGKILLed at a random moment while two "
    "model calls are in flight, and a new one started at once, with beat running and the "
    "default lease and sweep settings (below). 'Moving again' is the start of the retried "
    "call_model tick.",
    "- Scale: the tasks are queued with the worker stopped, then a fresh worker drains them; "
    "rates are over the window from the first to the last transition.",
    "- RSS is summed over the worker's process group (shared pages counted in each process).",
    "- Waiting (I25): N tasks whose first turn calls a tool on their `approve` list. With all "
    "N `waiting` and the broker queue drained, the workers are watched idle; then the 1-run and "
    "batch measurements are run again (the ones without were run before the N were submitted; "
    "ratios are of medians). Leases, calls and statuses are sampled every 0.5 s meanwhile; a "
    "sweep re-publish is a `swept_at` set on their run or call, or a line of beat's log. Scans: "
    "beat's read-only queries for due work, one round, median of 10. On PostgreSQL the scans, "
    "and but for `--quick` the runs with the N waiting, are measured again after an ANALYZE "
    "(what autovacuum does to a fresh database). Then every held call is approved "
    "(`charlie.approve`, one at a time) and the N run to their final answer; an approved "
    "call's deadline (the tool's, 60 s) runs from its approve, its wait in the queue included.",
    "- Console: times are the client's, over loopback, 50 tasks a list page; the task page is "
    "its header, open calls, actions, the timeline SVG of the whole run and the latest 300 "
    "transcript rows (a call's whole record loads when its row is opened); `?all=1` has every "
    "row. In Chromium, 'usable' is the navigation's load event (HTML parsed, "
    "style and script loaded, the live poll started). The list's tasks are inserted with SQL, "
    "a tenth of them failed, canceled, waiting or running; the search matches about 1 in 97.",
]


def code_version() -> str:
    """The commit measured, and whether the code differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "charlie", "celeryconfig.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown commit"
    if not head:
        return "unknown commit"
    return f"commit {head}" + (" with uncommitted changes to charlie/" if dirty else "")


def machine_line(results: dict[str, dict[str, Any]]) -> str:
    from importlib.metadata import version

    servers: dict[str, str] = {}
    for r in results.values():
        servers.update(r["info"].get("versions", {}))
    parts = [
        f"nproc {os.cpu_count()}",
        f"{platform.system()} {platform.machine()}",
        f"Python {platform.python_version()}",
        f"Celery {version('celery')}",
        f"kombu {version('kombu')}",
        f"SQLAlchemy {version('sqlalchemy')}",
    ]
    parts += [f"{k} {v}" for k, v in sorted(servers.items())]
    return "Machine: " + ", ".join(parts)


def start_child(backend: Backend, args: argparse.Namespace, home: Path) -> subprocess.Popen[bytes]:
    """This script again, as ``--child BACKEND``, with that backend's environment."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", backend.name]
    argv += ["--result", str(home / "result.json"), "--only", ",".join(args.only)]
    if args.quick:
        argv.append("--quick")
    if args.trials:
        argv += ["--trials", str(args.trials)]
    if args.scale_tasks:
        argv += ["--scale-tasks", str(args.scale_tasks)]
    if args.waiting_tasks:
        argv += ["--waiting-tasks", str(args.waiting_tasks)]
    if args.keep:
        argv.append("--keep")
    for kv in args.worker_env:
        argv += ["--worker-env", kv]
    if args.dbos_python:
        argv += ["--dbos-python", args.dbos_python]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLIE_", "BENCH_"))}
    env.update(
        {
            k: os.environ[k]
            for k in ("BENCH_PG_DATABASE", "BENCH_REDIS_DB", "BENCH_LIMITS_LATENCY")
            if k in os.environ
        }
    )
    env.update(  # where the streaming scenario's transports are
        {k: v for k, v in os.environ.items() if k.startswith("BENCH_STREAM_")}
    )
    env.update(backend.env(home))
    env["CHARLIE_TOOL_MODULES"] = "_bench_support"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH")])
    )
    return subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL)


def run_children(
    backends: list[Backend], args: argparse.Namespace, parallel: bool
) -> dict[str, dict[str, Any]]:
    """Run one child per backend, one after the other or all at once; collect their results.

    Whatever happens here (Ctrl-C included), every child and every process group a child
    started is gone when this returns."""
    homes: dict[str, Path] = {}
    running: dict[str, subprocess.Popen[bytes]] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for backend in backends:
            homes[backend.name] = Path(tempfile.mkdtemp(prefix=f"charlie-bench-{backend.name}-"))
            running[backend.name] = start_child(backend, args, homes[backend.name])
            if not parallel:
                running[backend.name].wait()
        for child in running.values():
            child.wait()
    finally:
        for child in running.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for name, child in running.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=30)
            if child.poll() is None:
                child.kill()
                child.wait()
            kill_groups_listed(homes[name] / "pgids")
        for name, home in homes.items():
            path = home / "result.json"
            if path.exists():
                results[name] = dict(json.loads(path.read_text()))
            else:
                code = running[name].returncode if name in running else None
                results[name] = {
                    "values": {},
                    "notes": [f"the run exited {code} with no results"],
                    "info": {},
                    "failed": True,
                }
            if args.keep or results[name].get("failed"):
                print(f"[{name}] home and logs kept in {home}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(home, ignore_errors=True)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 trial, small sizes (under a minute)")
    p.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="all")
    p.add_argument("--trials", type=int, default=None, help="trials per figure (default 5)")
    p.add_argument(
        "--only",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(DEFAULT_SCENARIOS),
        help="comma-separated subset of " + ",".join(SCENARIOS) + " (default: all but growth)",
    )
    p.add_argument(
        "--scale-tasks", type=int, default=None, help="tasks in the scale run (default 5000)"
    )
    p.add_argument(
        "--waiting-tasks",
        type=int,
        default=None,
        help="tasks left waiting for an approval in the waiting run (default 1000)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    p.add_argument("--keep", action="store_true", help="keep homes, logs and the PG database")
    p.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the workers and beat (for experiments, e.g. "
        "CHARLIE_TASK_EVENTS=0); the table is then not the default configuration's",
    )
    p.add_argument(
        "--dbos-python",
        default=None,
        metavar="PYTHON",
        help="an interpreter with the dbos package, to compare DBOS on the PostgreSQL round "
        "(default: this one, if dbos is importable here)",
    )
    p.add_argument(
        "--sandbox-start",
        type=int,
        default=None,
        metavar="N",
        help="only measure run_command's start time: a sandboxed `true`, median of N runs",
    )
    p.add_argument("--child", choices=sorted(BACKENDS), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.only) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {SCENARIOS}")
    if args.trials is not None and args.trials < 1:
        p.error("--trials must be at least 1")
    if args.scale_tasks is not None and args.scale_tasks < 1:
        p.error("--scale-tasks must be at least 1")
    if args.waiting_tasks is not None and args.waiting_tasks < 1:
        p.error("--waiting-tasks must be at least 1")
    if any("=" not in kv for kv in args.worker_env):
        p.error("--worker-env takes KEY=VALUE")
    return args


def dbos_python(args: argparse.Namespace) -> str | None:
    """The interpreter to run DBOS with, or None when there is none."""
    if args.dbos_python:
        return str(args.dbos_python)
    return sys.executable if importlib.util.find_spec("dbos") is not None else None


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C and SIGTERM unwind through the clean-up code, even where SIGINT was inherited
    # ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if args.child:
            run_backend(BACKENDS[args.child], args, args.result)
            return 0
        if args.sandbox_start is not None:
            return sandbox_start(args.sandbox_start)
        return run_parent(args)
    except KeyboardInterrupt:
        print(f"[{_progress.tag}] interrupted; child processes stopped", file=sys.stderr)
        return 130


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


def run_parent(args: argparse.Namespace) -> int:
    command = " ".join(["python", "scripts/bench.py", *sys.argv[1:]])
    wanted = list(BACKENDS) if args.backend == "all" else [args.backend]
    sizes = sizes_for(args)
    skipped: dict[str, str] = {}
    started = time.perf_counter()
    version = code_version()
    runnable = []
    for name in wanted:
        problem = backend_problem(BACKENDS[name])
        if problem:
            skipped[name] = problem
            print(f"[{name}] skipped: {problem}", file=sys.stderr, flush=True)
        else:
            runnable.append(BACKENDS[name])
    # --quick is a smoke run whose figures nobody judges: its backends run side by side.
    results = run_children(runnable, args, parallel=args.quick)
    for r in results.values():
        derive(r["values"])
    labels = {n: BACKENDS[n].label for n in BACKENDS}
    if code_version() != version:
        version += f" (the tree changed during the run: now {code_version()})"
    table = render(results, labels, skipped, command, sizes, args.worker_env, version)
    print(table)
    print(f"\n(bench took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "results": results}, indent=1))
    return 1 if any(r.get("failed") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
