"""Crash harness: run many agent tasks while SIGKILLing random workers, then check every promise.

The options, the cluster, the submits and the wait; ``scripts/chaos.py`` is the entry point and
its docstring says what is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from chaos_kinds.checks import check
from chaos_kinds.harness import Plan, task_script
from chaos_kinds.kills import Killer
from chaos_kinds.mcp import add_mcp_turn, mcp_violations
from chaos_kinds.person import Person
from tests.support.cluster import (
    Backend,
    Cluster,
    McpServers,
    cluster_env,
    default_pool,
    flush_redis,
    recreate_postgres_database,
)

#: a threads worker's slots in the chaos round, unless --concurrency says otherwise
THREADS_CONCURRENCY = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--pool",
        choices=["prefork", "threads"],
        default=None,
        help="the workers' pool (default prefork, or CHARLIE_TEST_POOL's): on threads a kill "
        "takes every call its process held at once",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="each worker's slots (default 2 on prefork; 8 on threads: a kill takes many calls "
        "at once, and the first questions still outnumber the slots with tasks to spare)",
    )
    p.add_argument("--database-url", default=None, help="default: SQLite in a temp home")
    p.add_argument("--broker-url", default=None, help="default: the embedded broker")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many s")
    p.add_argument(
        "--hold-back",
        type=float,
        default=60.0,
        help="once the first questions all wait, the person answers nothing for at most this "
        "long (I25)",
    )
    p.add_argument(
        "--mcp-share", type=float, default=0.25, help="share of tasks calling MCP tools (0: none)"
    )
    args = p.parse_args()
    args.pool = args.pool or default_pool()
    if args.concurrency is None:
        args.concurrency = THREADS_CONCURRENCY if args.pool == "threads" else 2
    return args


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="charlie-chaos-"))
    (home / "scripts").mkdir()
    backend = Backend("chaos", args.database_url, args.broker_url)
    mcp = McpServers(home, 0, 0, 0, only=("files",)) if args.mcp_share > 0 else None
    env = cluster_env(home, backend, mcp=mcp)
    # Default recovery settings: the figures below are what an operator gets. Questions wait
    # as long as the person takes (the default deadline is a day).
    for key in (
        "CHARLIE_LEASE_SECONDS",
        "CHARLIE_STALL_SECONDS",
        "CHARLIE_SWEEP_INTERVAL",
        "CHARLIE_MAX_ATTEMPTS",
        "CHARLIE_DISPATCH_BATCH",
        "CHARLIE_HUMAN_DEADLINE",
    ):
        env.pop(key)
    for key in [k for k in os.environ if k.startswith("CHARLIE_")]:
        del os.environ[key]
    os.environ.update(env)
    if args.database_url and args.database_url.startswith("postgresql"):
        recreate_postgres_database(args.database_url)
    if args.broker_url and args.broker_url.startswith("redis"):
        flush_redis(args.broker_url)

    import charlie
    from charlie import api
    from charlie.config import settings
    from charlie.store.engine import upgrade

    upgrade(settings().database_url)
    cluster = Cluster(home=home, backend=backend, settings_env=env)
    cluster.pool, cluster.concurrency = args.pool, args.concurrency
    cluster.set_faults({})
    cluster.ensure(workers=args.workers, beat=True)
    cluster.supervise()
    # The first kill waits for the first workers: on a busy machine a worker takes longer to
    # boot than the kill interval, and one killed booting tests no recovery.
    ready_by = time.time() + 60
    while (
        time.time() < ready_by
        and sum(" ready." in log.read_text(errors="replace") for log in home.glob("worker-*.log"))
        < args.workers
    ):
        time.sleep(0.5)
    time.sleep(2)
    slots = args.workers * args.concurrency
    # More questions than worker slots wait at once at the start (I25), leaving other tasks.
    early = min(slots + 1, max(0, args.tasks - 2))
    plans: dict[str, Plan] = {}
    for n in range(args.tasks):
        plan = task_script(rng, home, n, early_ask=n < early)
        add_mcp_turn(plan, args.mcp_share, args.seed)
        (home / "scripts" / f"task-{n}.json").write_text(json.dumps(plan.turns))
        plans[plan.task_id] = plan
    print(
        f"chaos: {args.tasks} tasks, kill every {args.kill_every}s, {args.workers} workers "
        f"x {args.concurrency} ({args.pool}), db {settings().database_url.split(':')[0]}, "
        f"broker {settings().broker_url.split(':')[0]}, home {home}",
        flush=True,
    )

    killer = Killer(cluster, args.kill_every, rng)
    person = Person(plans, random.Random(args.seed + 1), home, slots, args.hold_back)
    started = time.time()
    try:
        killer.start()
        person.start()
        for plan in list(plans.values()):
            at = time.time()
            charlie.submit(
                f"chaos task {plan.n}",
                model=f"scripted:{home / 'scripts' / f'task-{plan.n}.json'}",
                task_id=plan.task_id,
                approve=plan.approve,
            )
            person.schedule(plan, None, at)
        deadline = started + args.timeout
        done: set[str] = set()
        while time.time() < deadline:
            for task_id in [t for t in list(plans) if t not in done]:
                if api.get_task(task_id).terminal:
                    done.add(task_id)
            if len(done) == len(plans) and person.idle():
                break
            time.sleep(0.5)
        pending = set(plans) - done
        killer.stop.set()
        killer.join()
        person.stop.set()
        person.join()
        # Let children and late reports land before checking.
        time.sleep(3)
        code = check(args, killer, person, plans, started, pending)
        problems = mcp_violations(home)
        for problem in problems:
            print(f"  - {problem}")
        return 1 if problems else code
    finally:
        killer.stop.set()
        person.stop.set()
        cluster.stop()
