#!/usr/bin/env python
"""Crash harness: run many agent tasks while SIGKILLing random workers, then check every promise.

    python scripts/chaos.py --tasks 200 --kill-every 2
    python scripts/chaos.py --tasks 30 --broker-url redis://127.0.0.1:6379/13 \
        --database-url postgresql://postgres@127.0.0.1/charlie_chaos

Starts N worker processes and one beat (default sweep settings), submits tasks whose scripted
models call a mix of tools (quick reads, slow reads, writes recorded in a ledger outside
Charlie's tables, writes with a read-back reconcile hook, delegations with waits), and kills a
random worker's whole process group every few seconds; a supervisor restarts it. Then it checks
every task and exits non-zero on any violation:

- terminal status reached, and succeeded;
- every tool call has exactly one result, and the transcript's results are in call order (I7, I8);
- no write executed twice according to the ledger (I10);
- every call caught mid-flight by a kill settled interrupted or reconciled, or, for a resumable
  wait, was observed again; never dropped (I10);
- exactly one child per delegation (I19);
- a share of tasks (``--mcp-share``) also calls an MCP read and an MCP write over stdio (the
  test server of tests/support/mcp_server.py, one per worker process); no MCP write executed
  twice according to the server's own ledger (I10, issue 15).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.cluster import (  # noqa: E402
    Backend,
    Cluster,
    McpServers,
    cluster_env,
    flush_redis,
    recreate_postgres_database,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--database-url", default=None, help="default: SQLite in a temp home")
    p.add_argument("--broker-url", default=None, help="default: the embedded broker")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many s")
    p.add_argument(
        "--mcp-share", type=float, default=0.25, help="share of tasks calling MCP tools (0: none)"
    )
    return p.parse_args()


def add_mcp_turn(turns: list[dict[str, Any]], n: int, share: float, seed: int) -> None:
    """For a share of tasks, one more turn before the last: an MCP read and an MCP write over
    stdio. Its own random stream, so the rest of a seed's run is what it was without it."""
    rng = random.Random(f"{seed}-mcp-{n}")
    if rng.random() >= share:
        return
    calls = [
        {"id": "mr", "name": "mcp__files__lookup", "arguments": {"key": f"m-{n}"}},
        {
            "id": "mw",
            "name": "mcp__files__delete_record",
            "arguments": {"key": f"m-{n}", "hold": rng.uniform(0, 1)},
        },
    ]
    turns.insert(len(turns) - 1, {"say": "the MCP tools", "tool_calls": calls})


def mcp_violations(home: Path) -> list[str]:
    """I10 for MCP writes: the test server's ledger, outside Charlie, ran each at most once."""
    ledger = McpServers(home, 0, 0, 0).ledger
    if not ledger.exists():
        return []
    rows = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    runs = Counter(r["key"] for r in rows if r["event"] == "delete.start")
    return [f"MCP write {key} ran {count}x" for key, count in runs.items() if count > 1]


def task_script(rng: random.Random, home: Path, n: int) -> tuple[list[dict[str, Any]], bool]:
    """A task's turns: a random mix of the tool kinds; returns (turns, delegates?)."""
    turns: list[dict[str, Any]] = []
    first = [
        {"id": "quick", "name": "sleep_then", "arguments": {"seconds": 0.05, "value": "q"}},
        {
            "id": "slow",
            "name": "sleep_then",
            "arguments": {"seconds": rng.uniform(0.5, 2), "value": "s"},
        },
        {
            "id": "write",
            "name": "ledger_write",
            "arguments": {"key": f"w-{n}", "hold": rng.uniform(0, 1)},
        },
    ]
    rng.shuffle(first)
    turns.append({"say": "first look", "sleep": rng.uniform(0, 0.4), "tool_calls": first})
    turns.append(
        {
            "say": "careful write",
            "tool_calls": [
                {
                    "id": "iw",
                    "name": "idempotent_write",
                    "arguments": {"key": f"iw-{n}", "hold": rng.uniform(0, 0.8)},
                }
            ],
        }
    )
    delegates = rng.random() < 0.3
    if delegates:
        child = home / "scripts" / f"child-{n}.json"
        child.write_text(
            json.dumps(
                [
                    {
                        "tool_calls": [
                            {
                                "id": "cq",
                                "name": "sleep_then",
                                "arguments": {"seconds": 0.2, "value": "c"},
                            }
                        ]
                    },
                    {"say": "child done", "sleep": rng.uniform(0, 0.5)},
                ]
            )
        )
        turns.append(
            {
                "tool_calls": [
                    {
                        "id": "d",
                        "name": "delegate",
                        "arguments": {"prompt": "child", "model": f"scripted:{child}"},
                    }
                ]
            }
        )
        turns.append(
            {
                "tool_calls": [
                    {
                        "id": "wait",
                        "name": "wait_for_task",
                        "arguments": {"task_id": "{task_id}.2.d"},
                    }
                ]
            }
        )
    turns.append({"say": f"task {n} finished"})
    return turns, delegates


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


class Killer(threading.Thread):
    def __init__(self, cluster: Cluster, every: float, rng: random.Random) -> None:
        super().__init__(daemon=True, name="killer")
        self.cluster, self.every, self.rng = cluster, every, rng
        self.stop = threading.Event()
        self.kills: list[tuple[float, set[int]]] = []
        #: what each kill caught: (kill time, kind, execution id, turn, call id)
        self.held: list[tuple[float, str, str, int, str]] = []

    def snapshot(self, pids: set[int], at: float) -> None:
        """What the killed worker held: run leases and call leases (the work to recover)."""
        from sqlalchemy import select

        from charlie.runtime import get_runtime
        from charlie.store.engine import read
        from charlie.store.schema import executions, tool_calls

        def mine(owner: str | None) -> bool:
            return bool(owner) and int(str(owner).rsplit(":", 1)[1]) in pids

        e, c = executions.c, tool_calls.c
        with read(get_runtime().engine) as conn:
            for row in conn.execute(select(e.id, e.lease_owner).where(e.lease_owner.is_not(None))):
                if mine(row.lease_owner):
                    self.held.append((at, "run", row.id, 0, ""))
            for row in conn.execute(
                select(c.execution_id, c.turn, c.call_id, c.lease_owner).where(
                    c.state == "started", c.lease_owner.is_not(None)
                )
            ):
                if mine(row.lease_owner):
                    self.held.append((at, "call", row.execution_id, row.turn, row.call_id))

    def run(self) -> None:
        while not self.stop.wait(self.every):
            alive = self.cluster.alive_workers()
            if not alive:
                continue
            victim = self.rng.choice(alive)
            pids = set(group_pids(victim.pid))
            at = time.time()
            self.cluster.kill(victim)
            self.kills.append((at, pids))
            self.snapshot(pids, at)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="charlie-chaos-"))
    (home / "scripts").mkdir()
    backend = Backend("chaos", args.database_url, args.broker_url)
    mcp = McpServers(home, 0, 0, 0, only=("files",)) if args.mcp_share > 0 else None
    env = cluster_env(home, backend, mcp=mcp)
    # Default recovery settings: the figures below are what an operator gets.
    for key in (
        "CHARLIE_LEASE_SECONDS",
        "CHARLIE_STALL_SECONDS",
        "CHARLIE_SWEEP_INTERVAL",
        "CHARLIE_MAX_ATTEMPTS",
        "CHARLIE_DISPATCH_BATCH",
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
    cluster.set_faults({})
    cluster.ensure(workers=args.workers, beat=True)
    cluster.supervise()
    time.sleep(2)
    print(
        f"chaos: {args.tasks} tasks, kill every {args.kill_every}s, {args.workers} workers "
        f"x {args.concurrency}, db {settings().database_url.split(':')[0]}, "
        f"broker {settings().broker_url.split(':')[0]}, home {home}",
        flush=True,
    )

    killer = Killer(cluster, args.kill_every, rng)
    started = time.time()
    task_ids: dict[str, bool] = {}
    try:
        killer.start()
        for n in range(args.tasks):
            turns, delegates = task_script(rng, home, n)
            add_mcp_turn(turns, n, args.mcp_share, args.seed)
            path = home / "scripts" / f"task-{n}.json"
            path.write_text(json.dumps(turns))
            task_ids[
                charlie.submit(f"chaos task {n}", model=f"scripted:{path}", task_id=f"chaos-{n}")
            ] = delegates
        deadline = started + args.timeout
        pending = set(task_ids)
        while pending and time.time() < deadline:
            pending = {t for t in pending if not api.get_task(t).terminal}
            time.sleep(0.5)
        killer.stop.set()
        killer.join()
        # Let children and late reports land before checking.
        time.sleep(3)
        return check(args, cluster, killer, task_ids, started, pending)
    finally:
        killer.stop.set()
        cluster.stop()


def check(
    args: argparse.Namespace,
    cluster: Cluster,
    killer: Killer,
    task_ids: dict[str, bool],
    started: float,
    unfinished: set[str],
) -> int:
    from sqlalchemy import select

    from charlie import api
    from charlie.runtime import get_runtime
    from charlie.store.engine import read
    from charlie.store.schema import tool_calls, transitions
    from tests.support.tools import read_ledger

    violations: list[str] = mcp_violations(cluster.home)
    stats: Counter[str] = Counter()
    ledger = read_ledger()
    executed = Counter((e["task"], e["call"]) for e in ledger if e["event"] == "write")
    killed_ids = {pid for _, pids in killer.kills for pid in pids}
    for task_id in unfinished:
        violations.append(f"{task_id}: not terminal after {args.timeout}s")
    for task_id, delegates in task_ids.items():
        info = api.get_task(task_id)
        if task_id not in unfinished and info.status.value != "succeeded":
            violations.append(f"{task_id}: ended {info.status.value}: {str(info.error)[:200]}")
        stats["model_repeats"] += info.model_repeats
        items = api.transcript(task_id)
        calls = api.calls(task_id)
        by_turn: dict[int, list[str]] = defaultdict(list)
        for item in items:
            if item.kind == "tool_result":
                by_turn[item.turn].append(item.call_id or "")
        results = Counter((i.turn, i.call_id) for i in items if i.kind == "tool_result")
        for call in calls:
            if results[(call.turn, call.call_id)] != 1 and info.status.value == "succeeded":
                violations.append(
                    f"{task_id}/{call.call_id}: {results[(call.turn, call.call_id)]} results"
                )
            stats["calls"] += 1
            stats["late_reports"] += call.late_reports
            if call.outcome == "interrupted":
                stats["interrupted"] += 1
            if isinstance(call.result, dict) and call.result.get("reconciled"):
                stats["reconciled"] += 1
            if (
                call.name in ("ledger_write", "idempotent_write")
                and executed[(task_id, call.call_id)] > 1
            ):
                violations.append(
                    f"{task_id}/{call.call_id}: write ran {executed[(task_id, call.call_id)]}x"
                )
                stats["duplicates"] += 1
            if call.state != "settled":
                violations.append(f"{task_id}/{call.call_id}: left {call.state}")
                stats["orphans"] += 1
            pid = int(call.started_by.rsplit(":", 1)[1]) if call.started_by else None
            settler = call.settled_by or ""
            caught = pid in killed_ids and not settler.endswith(f":{pid}")
            if (
                caught
                and call.name != "wait_for_task"
                and call.outcome == "ok"
                and not (isinstance(call.result, dict) and call.result.get("reconciled"))
            ):
                violations.append(
                    f"{task_id}/{call.call_id}: caught by a kill but reported plain ok"
                )
            if caught:
                stats["caught_mid_flight"] += 1
        for turn, ids in by_turn.items():
            order = [
                c.call_id
                for c in sorted((c for c in calls if c.turn == turn), key=lambda c: c.index)
            ]
            if ids != order:
                violations.append(f"{task_id} turn {turn}: results {ids} != call order {order}")
        if delegates:
            delegations = [c for c in api.calls(task_id) if c.name == "delegate"]
            kids = charlie_children(task_id)
            # I19: one child per delegation. Recovery finishes a delegation its worker died in,
            # so only an `interrupted` call (its workers died max_attempts times, or recovery
            # itself failed) may end without its child; an `error` one never made it.
            outcomes = {c.outcome for c in delegations}
            if (
                len(delegations) != 1
                or len(kids) > 1
                or ("ok" in outcomes and not kids)
                or ("error" in outcomes and kids)
            ):
                shown = [(c.call_id, c.outcome, str(c.result)[:160]) for c in delegations]
                violations.append(
                    f"{task_id}: {len(kids)} children for {len(delegations)} delegations {shown}"
                )
            stats["children"] += len(kids)

    # Time from each kill to what it interrupted moving again: a held run's next transition, a
    # held call's settlement (or, for a parked wait, its next claim).
    rt = get_runtime()
    recoveries: list[float] = []
    with read(rt.engine) as conn:
        moves = conn.execute(select(transitions.c.execution_id, transitions.c.at)).all()
        settled = {
            (r.execution_id, r.turn, r.call_id): r.settled_at
            for r in conn.execute(
                select(
                    tool_calls.c.execution_id,
                    tool_calls.c.turn,
                    tool_calls.c.call_id,
                    tool_calls.c.settled_at,
                )
            )
        }
    by_run: dict[str, list[float]] = defaultdict(list)
    for m in moves:
        by_run[m.execution_id].append(m.at.timestamp())
    for at, kind, execution_id, turn, call_id in killer.held:
        if kind == "run":
            after = [t for t in by_run[execution_id] if t > at]
            if after:
                recoveries.append(min(after) - at)
        else:
            done = settled.get((execution_id, turn, call_id))
            if done is not None and done.timestamp() > at:
                recoveries.append(done.timestamp() - at)
    elapsed = time.time() - started
    print()
    print(
        "| tasks | kills | calls | caught mid-flight | interrupted | reconciled | late reports | "
        "model repeats | duplicates | orphans | kill → progress p50 / p95 | wall time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(task_ids)} | {len(killer.kills)} | {stats['calls']} | "
        f"{stats['caught_mid_flight']} | "
        f"{stats['interrupted']} | {stats['reconciled']} | {stats['late_reports']} | "
        f"{stats['model_repeats']} | {stats['duplicates']} | {stats['orphans']} | "
        f"{pct(recoveries, 0.5):.1f} s / {pct(recoveries, 0.95):.1f} s (n={len(recoveries)}) | "
        f"{elapsed:.0f} s |"
    )
    if violations:
        print(f"\n{len(violations)} violation(s):")
        for v in violations[:50]:
            print(f"  - {v}")
        return 1
    print("\nno violations")
    return 0


def charlie_children(task_id: str) -> list[str]:
    from charlie.runtime import get_runtime
    from charlie.scheduler import descendants

    return descendants(get_runtime().engine, task_id)


if __name__ == "__main__":
    sys.exit(main())
