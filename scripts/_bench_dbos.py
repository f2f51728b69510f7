"""DBOS, for comparison: the same two steps per agent turn, as a DBOS workflow.

Run by ``scripts/bench.py`` with an interpreter that has the ``dbos`` package (``--dbos-python``,
or the benchmark's own if ``dbos`` is importable there); not a Charlie dependency. Each turn is
a model step and a tool step that return at once, so what is measured is DBOS's own cost per
step: its checkpoint of each step's outcome in PostgreSQL. Prints one JSON document:
``{"version", "turn_ms": [...], "one_steps_s": [...], "many_steps_s": [...]}`` and, per turn,
for the single workflow (``one_``) and the concurrent ones (``many_``): ``turn_ms`` (wall time
over every turn), ``commits_per_turn`` (counted in this process as the benchmark counts
Charlie's in its workers: SQLAlchemy commits and autocommit writes), ``server_commits_per_turn``
(``pg_stat_database.xact_commit`` of its database, read after the server's stats settle) and
``wal_bytes_per_turn`` (the server's WAL insert position before and after).

    python scripts/_bench_dbos.py --database-url postgresql://postgres@127.0.0.1/charlie_bench_dbos

Two more shapes, each for a figure of ``scripts/bench.py`` (``--figure``):

``inflight``
    ``--tasks`` agents enqueued at once on a DBOS queue of ``--concurrency``, each a workflow
    of a model step (an HTTP request to ``--model-url``, an OpenAI-style chat completion), an
    instant tool step and a second model step, as Charlie's in-flight figure runs its tasks.
    Prints ``{"version", "wall_s", "rss_mib"}`` (the wall from the first enqueue to the last
    result; the process's peak RSS).
``fleet``
    ``--runs`` workflows enqueued at once on a DBOS queue (no concurrency limit), each
    ``--runs-turns`` turns of a model step and a tool step that return at once. Prints
    ``{"version", "wall_s", "turns", "turns_per_s", "wal_bytes_per_turn"}`` (WAL: the
    server's ``pg_current_wal_lsn`` before and after, the whole server's).

``paired``
    Serves the turn figure's single workflow on request, for a comparison taken in pairs: it
    prints ``{"ready": version}`` once DBOS is launched and warm, then for each line of stdin
    (a number of turns) runs one workflow of that many turns and prints ``{"turn_ms": ...}``.
    Ends at the end of stdin.

A queue polls for work every ``--queue-poll`` seconds (DBOS's default, 1 s, unless
``BENCH_DBOS_QUEUE_POLL`` says otherwise): up to one interval of each wall is the wait for the
first poll.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import psycopg
from sqlalchemy.engine import make_url


def recreate(url: str) -> None:
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{parsed.database}"')


class Commits:
    """Write commits this process makes: the same rule as scripts/_bench_support.py."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def install(self) -> None:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine

        def on_statement(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT" and not (
                statement.lstrip()[:6].upper().startswith("SELECT")
            ):
                with self.lock:
                    self.count += 1

        def on_commit(conn: Any) -> None:
            if not conn.get_execution_options().get("readonly"):
                with self.lock:
                    self.count += 1

        event.listen(Engine, "before_cursor_execute", on_statement)
        event.listen(Engine, "commit", on_commit)


def server(url: str, settle: float) -> tuple[int, int]:
    """(xact_commit of the database, after its stats settle; the WAL insert position now)."""
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        lsn = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
        if settle:
            time.sleep(settle)
        xact = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (parsed.database,)
        ).fetchone()
    assert lsn is not None and xact is not None
    return int(xact[0] or 0), int(lsn[0])


def wal_position(url: str) -> int:
    """The server's WAL write position, in bytes (``pg_current_wal_lsn``)."""
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def peak_rss_mib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def inflight(args: argparse.Namespace) -> dict[str, object]:
    """Agents of two model calls (an HTTP request each) and a tool step, from a queue."""
    import httpx
    from dbos import DBOS

    DBOS(config={"name": "charlie-bench-inflight", "system_database_url": args.database_url})
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=args.concurrency))

    @DBOS.step()
    def model_step(prompt: str, tool_result: str | None) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        if tool_result is not None:
            messages.append({"role": "tool", "tool_call_id": "c1", "content": tool_result})
        body = {"model": "bench-model", "messages": messages}
        reply = client.post(args.model_url.rstrip("/") + "/chat/completions", json=body)
        reply.raise_for_status()
        return dict(reply.json()["choices"][0]["message"])

    @DBOS.step()
    def tool_step(value: str) -> str:
        return value

    @DBOS.workflow()
    def agent(prompt: str) -> str:
        message = model_step(prompt, None)
        result = tool_step(str(message.get("tool_calls")))
        return str(model_step(prompt, result).get("content"))

    DBOS.launch()
    try:
        # a queue's slots on one executor, as a Charlie worker's are in its process
        queue = DBOS.register_queue(
            "agents", worker_concurrency=args.concurrency, polling_interval_sec=args.queue_poll
        )
        started = time.perf_counter()
        handles = [queue.enqueue(agent, f"agent {i}") for i in range(args.tasks)]
        for handle in handles:
            handle.get_result()
        wall = time.perf_counter() - started
    finally:
        DBOS.destroy()
        client.close()
    return {"version": version("dbos"), "wall_s": wall, "rss_mib": peak_rss_mib()}


def _turns_workflow() -> Callable[[int], int]:
    """The agent both turn figures run: a workflow whose every turn is a model step and a tool
    step, each returning at once (registered with the DBOS instance made just before)."""
    from dbos import DBOS

    @DBOS.step()
    def model_step(turn: int) -> int:
        return turn

    @DBOS.step()
    def tool_step(turn: int) -> int:
        return turn

    @DBOS.workflow()
    def agent(turns: int) -> int:
        for turn in range(turns):
            model_step(turn)
            tool_step(turn)
        return turns

    return agent


def fleet(args: argparse.Namespace) -> dict[str, object]:
    """``--runs`` workflows of ``--runs-turns`` turns (a model and a tool step), from a queue."""
    from dbos import DBOS

    DBOS(config={"name": "charlie-bench-fleet", "system_database_url": args.database_url})
    agent = _turns_workflow()

    DBOS.launch()
    try:
        queue = DBOS.register_queue("fleet", polling_interval_sec=args.queue_poll)
        queue.enqueue(agent, 2).get_result()  # warm up
        turns = args.runs * args.runs_turns
        lsn0 = wal_position(args.database_url)
        started = time.perf_counter()
        handles = [queue.enqueue(agent, args.runs_turns) for _ in range(args.runs)]
        for handle in handles:
            handle.get_result()
        wall = time.perf_counter() - started
        lsn1 = wal_position(args.database_url)
    finally:
        DBOS.destroy()
    return {
        "version": version("dbos"),
        "wall_s": wall,
        "turns": turns,
        "turns_per_s": turns / wall,
        "wal_bytes_per_turn": (lsn1 - lsn0) / turns,
    }


def paired(args: argparse.Namespace) -> None:
    """One workflow of the turns each stdin line asks for, timed, one JSON line each: the
    caller alternates these with its own runs, so a machine whose speed drifts moves both."""
    from dbos import DBOS

    DBOS(config={"name": "charlie-bench", "system_database_url": args.database_url})
    agent = _turns_workflow()
    DBOS.launch()
    try:
        agent(2)  # warm up
        print(json.dumps({"ready": version("dbos")}), flush=True)
        for line in sys.stdin:
            turns = int(line)
            started = time.perf_counter()
            agent(turns)
            elapsed = time.perf_counter() - started
            print(json.dumps({"turn_ms": elapsed / turns * 1000}), flush=True)
    finally:
        DBOS.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--database-url", required=True)
    p.add_argument("--figure", choices=["turns", "inflight", "fleet", "paired"], default="turns")
    p.add_argument("--turns", type=int, default=20, help="turns of the single workflow")
    p.add_argument("--runs", type=int, default=50, help="concurrent workflows")
    p.add_argument("--runs-turns", type=int, default=5, help="turns of each of them")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--model-url", default=None, help="inflight: the provider's base URL")
    p.add_argument("--tasks", type=int, default=1000, help="inflight: agents")
    p.add_argument("--concurrency", type=int, default=64, help="inflight: the queue's")
    p.add_argument(
        "--queue-poll",
        type=float,
        default=float(os.environ.get("BENCH_DBOS_QUEUE_POLL", "1.0")),
        help="seconds between a queue's polls (DBOS's default 1; BENCH_DBOS_QUEUE_POLL)",
    )
    args = p.parse_args()
    recreate(args.database_url)
    if args.figure == "paired":
        paired(args)
        return
    if args.figure != "turns":
        print(json.dumps(inflight(args) if args.figure == "inflight" else fleet(args)))
        return
    commits = Commits()
    commits.install()
    settle = float(os.environ.get("BENCH_PG_STATS_SETTLE", "11"))

    from dbos import DBOS

    DBOS(config={"name": "charlie-bench", "system_database_url": args.database_url})
    agent = _turns_workflow()

    DBOS.launch()
    out: dict[str, object] = {"version": version("dbos")}
    turn_ms, one, many = [], [], []
    figures: dict[str, list[float]] = {}

    def measured(which: str, turns: int, run: Any) -> float:
        """Run ``run``; record its per-turn figures under ``which``; return its seconds."""
        xact0, lsn0 = server(args.database_url, settle)
        commits0 = commits.count
        started = time.perf_counter()
        run()
        elapsed = time.perf_counter() - started
        counted = commits.count - commits0
        _, lsn1 = server(args.database_url, 0)
        xact1, _ = server(args.database_url, settle)
        for name, value in (
            ("turn_ms", elapsed / turns * 1000),
            ("commits_per_turn", counted / turns),
            ("server_commits_per_turn", (xact1 - xact0) / turns),
            ("wal_bytes_per_turn", (lsn1 - lsn0) / turns),
        ):
            figures.setdefault(f"{which}_{name}", []).append(value)
        return elapsed

    def many_workflows() -> None:
        handles = [DBOS.start_workflow(agent, args.runs_turns) for _ in range(args.runs)]
        for handle in handles:
            handle.get_result()

    try:
        agent(2)  # warm up
        for _ in range(args.trials):
            elapsed = measured("one", args.turns, lambda: agent(args.turns))
            turn_ms.append(elapsed / args.turns * 1000)
            one.append(2 * args.turns / elapsed)
            elapsed = measured("many", args.runs * args.runs_turns, many_workflows)
            many.append(2 * args.runs * args.runs_turns / elapsed)
    finally:
        DBOS.destroy()
    out.update(turn_ms=turn_ms, one_steps_s=one, many_steps_s=many, **figures)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
