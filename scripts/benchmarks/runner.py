"""Charlie's benchmark: what a transition and a turn cost, side by side with the floor.

The run: the parent starts one ``--child`` process per backend (Charlie reads its settings once
per process), each child puts a :class:`Cell` together from the figures' mixins and runs the
figures asked for (``--only``), and the parent prints the table. ``scripts/bench.py`` is the
entry point; its docstring describes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.console import ConsoleFigure
from benchmarks.dbos import DbosFigure
from benchmarks.fanout import FanoutFigure
from benchmarks.fleet import FleetFigure
from benchmarks.floor import FloorFigure
from benchmarks.growth import GrowthFigure
from benchmarks.harness import (
    BACKENDS,
    DEFAULT_SCENARIOS,
    PG_ADMIN,
    PG_URL,
    REDIS_URL,
    REPO,
    SCENARIOS,
    SCRIPTS,
    Backend,
    CellBase,
    _progress,
    backend_problem,
    drop_pg_database,
    flush_redis,
    kill_groups_listed,
    progress,
    recreate_pg_database,
    sizes_for,
)
from benchmarks.inflight import InflightFigure
from benchmarks.limits import LimitsFigure
from benchmarks.longrun import LongrunFigure
from benchmarks.recovery import RecoveryFigure
from benchmarks.sandbox_start import sandbox_start
from benchmarks.scale import ScaleFigure
from benchmarks.streaming import StreamingFigure
from benchmarks.table import code_version, derive, render
from benchmarks.transitions import TransitionsFigure
from benchmarks.waiting import WaitingFigure


class Cell(
    TransitionsFigure,
    FloorFigure,
    DbosFigure,
    FanoutFigure,
    RecoveryFigure,
    ScaleFigure,
    WaitingFigure,
    StreamingFigure,
    ConsoleFigure,
    LongrunFigure,
    LimitsFigure,
    InflightFigure,
    FleetFigure,
    GrowthFigure,
    CellBase,
):
    """One backend's benchmark: the harness and every figure, each a method of its name."""


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


def start_child(backend: Backend, args: argparse.Namespace, home: Path) -> subprocess.Popen[bytes]:
    """This script again, as ``--child BACKEND``, with that backend's environment."""
    argv = [sys.executable, str(SCRIPTS / "bench.py"), "--child", backend.name]
    argv += ["--result", str(home / "result.json"), "--only", ",".join(args.only)]
    if args.quick:
        argv.append("--quick")
    if args.trials:
        argv += ["--trials", str(args.trials)]
    if args.scale_tasks:
        argv += ["--scale-tasks", str(args.scale_tasks)]
    if args.waiting_tasks:
        argv += ["--waiting-tasks", str(args.waiting_tasks)]
    for flag, value in (
        ("--inflight-tasks", args.inflight_tasks),
        ("--inflight-prefork", args.inflight_prefork),
        ("--inflight-latency", args.inflight_latency),
        ("--inflight-worker-args", args.inflight_worker_args),
        ("--fleet-runs", args.fleet_runs),
        ("--fleet-turns", args.fleet_turns),
        ("--fleet-worker-args", args.fleet_worker_args),
    ):
        if value is not None:
            argv.append(f"{flag}={value}")  # (= keeps a value that starts with a dash)
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
    p.add_argument(
        "--inflight-tasks",
        type=int,
        default=None,
        help="inflight: tasks of two slow model calls on the worker as started (default 1000)",
    )
    p.add_argument(
        "--inflight-prefork",
        type=int,
        default=None,
        help="inflight: tasks on the old default, prefork with 2 processes (default 60)",
    )
    p.add_argument(
        "--inflight-latency",
        type=float,
        default=None,
        help="inflight: seconds the provider takes to answer each model call (default 2)",
    )
    p.add_argument(
        "--inflight-worker-args",
        default=None,
        metavar="ARGS",
        help='inflight: arguments for the first worker (default none; e.g. "-c 300")',
    )
    p.add_argument("--fleet-runs", type=int, default=None, help="fleet: runs at once (default 50)")
    p.add_argument(
        "--fleet-turns", type=int, default=None, help="fleet: turns of each run (default 20)"
    )
    p.add_argument(
        "--fleet-worker-args",
        default=None,
        metavar="ARGS",
        help="fleet: arguments for the worker (default none: as `charlie worker` starts)",
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
    for name in ("inflight_tasks", "inflight_prefork", "fleet_runs", "fleet_turns"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.inflight_latency is not None and args.inflight_latency <= 0:
        p.error("--inflight-latency must be positive")
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
