"""Where a turn's CPU goes: a worker through a 100-turn task (each turn one instant tool call,
as ``scripts/bench.py --only transitions`` drives it), profiled with cProfile counting CPU time
(``time.process_time``: load-robust, a loaded machine's waiting is not counted) and summed by
what the code is: SQLAlchemy, the database driver, JSON, logging, events, Celery and kombu's
publish and consume, the tick's planning, Charlie's store. Prints the shares, the top functions
by their own time, and the worker's process CPU time per turn (``/proc``, every thread of it,
measured in runs without the profiler; the profiler's own cost is not in it).

    python scripts/profile_turn.py                       # SQLite + the embedded broker
    python scripts/profile_turn.py --database-url postgresql://postgres@127.0.0.1/charlie_prof \\
        --broker-url redis://127.0.0.1:6379/9 --trials 3

The worker runs a solo pool (cProfile sees one thread; a solo pool consumes, runs and publishes
in its main thread). A standalone script the benchmark package can adopt as a figure later.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(REPO))

from tests.support.cluster import (  # noqa: E402
    Backend,
    Cluster,
    cluster_env,
    flush_redis,
    recreate_postgres_database,
)

TOOL = "bench_echo"

#: what a function's own CPU time counts as, by where its code is (first match wins); a
#: built-in function (file "~") is matched by its name
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("JSON encoding and decoding", ("/json/", "orjson", "'_json.", "json.")),
    ("logging", ("/logging/", "charlie/logs.py")),
    ("database driver (psycopg, sqlite3)", ("/psycopg", "sqlite3")),
    ("SQLAlchemy", ("/sqlalchemy/",)),
    (
        "Celery and kombu: publish, consume",
        ("/celery/", "/kombu/", "/redis/", "/amqp/", "/billiard/", "/vine/"),
    ),
    ("events and streams", ("charlie/executor/events.py", "charlie/streams/", "streamed.py")),
    ("telemetry", ("charlie/telemetry/", "charlie/observe.py", "opentelemetry")),
    ("Charlie's store: statements, rows", ("charlie/store/",)),
    (
        "the tick: planning, phases, tools",
        (
            "charlie/executor/",
            "charlie/scheduler.py",
            "charlie/runtime.py",
            "charlie/capacity.py",
            "charlie/leases.py",
            "charlie/models/",
            "charlie/tools/",
            "charlie/domain.py",
            "charlie/worker.py",
            "_bench_support",
        ),
    ),
    ("Charlie, other", ("charlie/",)),
    ("sockets and polling (syscalls)", ("socket", "select", "poll", "'recv", "'send")),
    ("copying, dataclasses, typing", ("copy.py", "dataclasses.py", "typing.py", "uuid.py")),
]
OTHER = "Python, other (stdlib, builtins)"


def category(filename: str, name: str) -> str:
    where = name if filename == "~" else "/" + filename.lstrip("/")
    for label, marks in CATEGORIES:
        if any(mark in where for mark in marks):
            return label
    return OTHER


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--trials", type=int, default=3, help="CPU-per-turn runs (no profiler)")
    p.add_argument("--top", type=int, default=15, help="functions listed by own time")
    p.add_argument("--database-url", default=None, help="default: SQLite in a temp home")
    p.add_argument("--broker-url", default=None, help="default: the embedded broker")
    p.add_argument(
        "--sampler",
        choices=("py-spy", "cprofile"),
        default="py-spy",
        help="py-spy: sampled, the GIL holder's stacks only, no distortion (needs py-spy, ptrace); "
        "cprofile: exact calls, but its own cost inflates functions called often",
    )
    p.add_argument("--py-spy", default=str(Path(sys.executable).with_name("py-spy")))
    p.add_argument(
        "--round-trips",
        action="store_true",
        help="PostgreSQL: also trace (libpq) every message the worker's connections send through "
        "one more run of the task, and print its round trips per turn by what they are",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p.parse_args()


def py_spy_own(path: Path) -> list[tuple[float, int, str, str]]:
    """py-spy's raw (collapsed) stacks, each sample counted to its innermost frame: (samples,
    0, function, category)."""
    own: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        name, _, where = leaf.partition(" (")
        where = where.rstrip(")")
        filename = where.rsplit(":", 1)[0] if where else "~"
        key = (f"{Path(filename).name}({name})", category(filename, name))
        own[key] = own.get(key, 0.0) + int(count)
    return [(n, 0, f, c) for (f, c), n in own.items()]


def round_trips(paths: list[Path], turns: int) -> dict[str, float]:
    """What the traced connections sent, per turn: each extended-protocol statement (Parse to
    Sync) and each simple query (``BEGIN``, ``COMMIT``, ...) is one round trip, a wait for the
    server's ReadyForQuery; statements are named by their first words."""
    counts: dict[str, int] = {}
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            fields = line.split("\t")
            if len(fields) < 3 or fields[0] != "F":
                continue
            kind, rest = fields[2].split(" ", 1)[0], line.split("\t", 3)[-1]
            if kind == "Query":
                what = f"simple query {rest.strip().strip(chr(34))[:30]}"
            elif kind == "Parse":
                parsed = re.match(r' *"[^"]*" "(.*)" \d+', rest)
                text = parsed.group(1) if parsed else rest
                what = "statement " + " ".join(text.split()[:3])[:40]
            else:
                continue
            counts[what] = counts.get(what, 0) + 1
    doc = {k: v / turns for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    doc["round trips, all"] = sum(counts.values()) / turns
    return doc


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system, every thread) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    args = parse_args()
    home = Path(tempfile.mkdtemp(prefix="charlie-profile-"))
    backend = Backend("profile", args.database_url, args.broker_url)
    env = cluster_env(home, backend)
    env["CHARLIE_TOOL_MODULES"] = "_bench_support"
    # as in production: no fault points armed (each would read the faults file), no test ledger
    env.pop("CHARLIE_FAULTS")
    env.pop("CHARLIE_TEST_LEDGER")
    for key in [k for k in os.environ if k.startswith("CHARLIE_")]:
        del os.environ[key]
    os.environ.update(env)
    if args.database_url and args.database_url.startswith("postgresql"):
        recreate_postgres_database(args.database_url)
    if args.broker_url and args.broker_url.startswith("redis"):
        flush_redis(args.broker_url)

    import charlie
    from charlie.config import settings
    from charlie.store.engine import upgrade

    upgrade(settings().database_url)
    ctl, out = home / "profile.ctl", home / "profile.out"
    cluster = Cluster(home=home, backend=backend, settings_env=env)
    scripts = home / "scripts"
    scripts.mkdir()

    def model(turns: int) -> str:
        call = {"tool_calls": [{"id": "c", "name": TOOL, "arguments": {"value": "x"}}]}
        path = scripts / f"turns-{turns}.json"
        path.write_text(json.dumps([call] * turns + [{"say": "done"}]))
        return f"scripted:{path}"

    def run(turns: int) -> None:
        task_id = charlie.submit("profile", model=model(turns), tools=[TOOL])
        info = charlie.wait(task_id, timeout=600)
        assert info.status.value == "succeeded", (task_id, info.error)

    # the cluster's own workers and beat come back when without_workers ends: stopped here,
    # or they outlive this script and take the next run's tasks from its worker
    try:
        with cluster.without_workers():
            worker_env = {
                "PROFILE_CTL": str(ctl),
                "PROFILE_OUT": str(out),
                "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)]),
            }
            if args.round_trips:
                worker_env["PROFILE_TRACE"] = "1"
            argv = ["worker", "--pool", "solo", "-n", "profile@%h", "--include", "_profile_hook"]
            proc = cluster._spawn(argv, "worker.log", worker_env)
            cluster.workers.append(proc)
            log = home / "worker.log"
            deadline = time.monotonic() + 120
            while " ready." not in (log.read_text(errors="replace") if log.exists() else ""):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"the worker did not start: see {log}")
                time.sleep(0.2)
            run(3)  # warm: imports, first connections, the tool registry
            cpu_ms, wall_ms = [], []
            for _ in range(args.trials):
                cpu0, wall0 = process_cpu(proc.pid), time.monotonic()
                run(args.turns)
                cpu_ms.append((process_cpu(proc.pid) - cpu0) * 1000 / args.turns)
                wall_ms.append((time.monotonic() - wall0) * 1000 / args.turns)
            trips: dict[str, float] = {}
            if args.round_trips:
                ctl.write_text("trace")
                run(args.turns)
                ctl.write_text("stop")
                run(3)  # each traced connection stops (and flushes) at its next checkout
                trips = round_trips(sorted(home.glob("profile.out.trace.*")), args.turns)
            rows: list[tuple[float, int, str, str]] = []
            if args.sampler == "py-spy":
                spy_out = home / "py-spy.txt"
                spy_argv = [args.py_spy, "record", "--pid", str(proc.pid), "--format", "raw"]
                # --gil: only the thread holding the GIL (running Python), not a waiting one
                spy_argv += ["--rate", "1000", "--gil", "--nonblocking", "--output", str(spy_out)]
                spy = subprocess.Popen(
                    spy_argv,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(2)  # attached
                cpu0 = process_cpu(proc.pid)
                run(args.turns)
                sampled_cpu = process_cpu(proc.pid) - cpu0
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
                rows = py_spy_own(spy_out)
            else:
                ctl.write_text("on")
                run(args.turns)
                ctl.write_text("off")
                run(1)  # its prerun stops the profile and writes it
                deadline = time.monotonic() + 60
                while not out.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                raw = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
                for (filename, line, name), (_cc, calls, own, _cum, _callers) in raw.items():
                    label = category(filename, name)
                    rows.append((own, calls, f"{Path(filename).name}:{line}({name})", label))
    finally:
        cluster.stop()

    shares: dict[str, float] = {}
    for own, _calls, _f, label in rows:
        shares[label] = shares.get(label, 0.0) + own
    samples = sum(shares.values()) or 1.0
    # py-spy counts samples: each its share of the CPU the worker used meanwhile
    total = sampled_cpu if args.sampler == "py-spy" else samples
    rows = [(own / samples * total, calls, f, c) for own, calls, f, c in rows]
    shares = {k: v / samples * total for k, v in shares.items()}
    rows.sort(reverse=True)
    doc = {
        "backend": backend.database_url or "sqlite + embedded broker",
        "turns": args.turns,
        "cpu_ms_per_turn": cpu_ms,
        "wall_ms_per_turn": wall_ms,
        "sampler": args.sampler,
        "profiled_cpu_ms_per_turn": total * 1000 / args.turns,
        "shares": {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "top": [
            {"own_ms_per_turn": own * 1000 / args.turns, "calls": calls, "function": f, "is": c}
            for own, calls, f, c in rows[: args.top]
        ],
        "load_average": os.getloadavg()[0],
        "round_trips_per_turn": trips,
    }
    if args.json:
        print(json.dumps(doc))
        return 0
    print(
        f"{args.turns}-turn task, one instant tool call a turn; worker: solo pool; {args.sampler}; "
        f"{doc['backend'].split(':')[0]}; load average {doc['load_average']:.1f}"
    )
    print(
        f"worker CPU per turn: {statistics.median(cpu_ms):.2f} ms (median of "
        f"{len(cpu_ms)}: {', '.join(f'{c:.2f}' for c in cpu_ms)}); wall "
        f"{statistics.median(wall_ms):.2f} ms; profiled {doc['profiled_cpu_ms_per_turn']:.2f} ms"
    )
    print(f"{'share':>6}  {'ms/turn':>7}  what")
    for label, share in doc["shares"].items():
        print(f"{share * 100:5.1f}%  {share * total * 1000 / args.turns:7.3f}  {label}")
    if trips:
        print("\nround trips to the database per turn (libpq trace, the worker's connections):")
        for what, n in trips.items():
            print(f"{n:7.2f}  {what}")
    print(f"\ntop {args.top} functions by own CPU time:")
    for row in doc["top"]:
        print(
            f"{row['own_ms_per_turn']:7.3f} ms/turn {row['calls']:>7} calls  "
            f"{row['function']}  [{row['is']}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
