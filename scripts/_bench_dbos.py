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
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--database-url", required=True)
    p.add_argument("--turns", type=int, default=20, help="turns of the single workflow")
    p.add_argument("--runs", type=int, default=50, help="concurrent workflows")
    p.add_argument("--runs-turns", type=int, default=5, help="turns of each of them")
    p.add_argument("--trials", type=int, default=1)
    args = p.parse_args()
    recreate(args.database_url)
    commits = Commits()
    commits.install()
    settle = float(os.environ.get("BENCH_PG_STATS_SETTLE", "11"))

    from dbos import DBOS

    DBOS(config={"name": "charlie-bench", "system_database_url": args.database_url})

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
