"""DBOS, for comparison: the same two steps per agent turn, as a DBOS workflow (issue 6).

Run by ``scripts/bench.py`` with an interpreter that has the ``dbos`` package (``--dbos-python``,
or the benchmark's own if ``dbos`` is importable there); not a Charlie dependency. Each turn is
a model step and a tool step that return at once, so what is measured is DBOS's own cost per
step: its checkpoint of each step's outcome in PostgreSQL. Prints one JSON document:
``{"version", "turn_ms": [...], "one_steps_s": [...], "many_steps_s": [...]}``.

    python scripts/_bench_dbos.py --database-url postgresql://postgres@127.0.0.1/charlie_bench_dbos
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version

import psycopg
from sqlalchemy.engine import make_url


def recreate(url: str) -> None:
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{parsed.database}"')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--database-url", required=True)
    p.add_argument("--turns", type=int, default=20, help="turns of the single workflow")
    p.add_argument("--runs", type=int, default=50, help="concurrent workflows")
    p.add_argument("--runs-turns", type=int, default=5, help="turns of each of them")
    p.add_argument("--trials", type=int, default=1)
    args = p.parse_args()
    recreate(args.database_url)

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
    try:
        agent(2)  # warm up
        for _ in range(args.trials):
            started = time.perf_counter()
            agent(args.turns)
            elapsed = time.perf_counter() - started
            turn_ms.append(elapsed / args.turns * 1000)
            one.append(2 * args.turns / elapsed)
            started = time.perf_counter()
            handles = [DBOS.start_workflow(agent, args.runs_turns) for _ in range(args.runs)]
            for handle in handles:
                handle.get_result()
            many.append(2 * args.runs * args.runs_turns / (time.perf_counter() - started))
    finally:
        DBOS.destroy()
    out.update(turn_ms=turn_ms, one_steps_s=one, many_steps_s=many)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
