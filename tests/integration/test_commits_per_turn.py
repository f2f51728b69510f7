"""What a turn costs in commits: a one-call turn in at most three, a turn of K calls
in at most K + 2.

A worker of its own on the session's backend counts its commits (tests/support/commits.py);
each shape of turn is run as a task of 2 turns and as one of 6, and the difference over the 4
turns between them is a steady turn's cost, the run's fixed commits (its first load, its final
answer and report) left out. On PostgreSQL a merged transaction is one statement and a read's
start rides in the model's commit (fused commits): a read turn commits twice, a write's three
times, a turn of K reads run at once K + 1 times and of K writes K + 2. On SQLite the steps are
written one by one and every start commits on its own: three, and K + 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import BACKEND, BACKEND_PROBLEM
from tests.support.cluster import (
    REPO,
    Backend,
    cluster_env,
    fused_commits,
    recreate_postgres_database,
)
from tests.support.commits import total

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        os.environ.get("CHARLIE_TEST_INLINE_PHASES") == "0",
        reason="with every step published nothing is merged: each phase commits on its own",
    ),
]

FUSED = fused_commits(BACKEND)

#: a steady turn's commits, by shape: fused (PostgreSQL) and stepwise (SQLite)
SHAPES = {
    # one read: A (the model's result, its dispatch, the read's start), B (its settle, the
    # turn's advance, the next model call's claim); stepwise the start commits apart
    "one read": ([("sleep_then", {"seconds": 0, "value": "v"})], 2, 3),
    # one write: its start commits apart (I11: a crash after A leaves it pending)
    "one write": ([("ledger_write", {"key": "k"})], 3, 3),
    # three reads at once (threadsafe tools): A with their starts, two settles as they end,
    # B with the last; stepwise a start commit for the three
    "three reads": ([("sleep_then", {"seconds": 0, "value": str(n)}) for n in range(3)], 4, 5),
    # three writes at once: A, one start commit for the three, two settles, B
    "three writes": ([("ledger_write", {"key": f"k{n}"}) for n in range(3)], 5, 5),
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A worker (and no beat: a sweep's commits are no turn's) on a database of its own."""
    if BACKEND_PROBLEM:
        pytest.skip(BACKEND_PROBLEM)
    home = tmp_path_factory.mktemp("commits")
    backend = Backend(BACKEND.name, None, None)
    if BACKEND.database_url and BACKEND.broker_url:
        # named after the suite's database, so suites on other databases do not share it; the
        # broker's db: CHARLIE_TEST_COMMITS_BROKER_URL, or 9 (when the suite's cluster runs
        # beside this worker, they must not share a queue)
        db = BACKEND.database_url + "_commits"
        recreate_postgres_database(db)
        broker = os.environ.get(
            "CHARLIE_TEST_COMMITS_BROKER_URL", BACKEND.broker_url.rsplit("/", 1)[0] + "/9"
        )
        if broker.startswith("redis"):
            import redis

            redis.Redis.from_url(broker).flushdb()
        backend = Backend(BACKEND.name, db, broker)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update(cluster_env(home, backend))
    counts = home / "commits"
    counts.mkdir()
    # A long lease: no renewal falls inside a turn (the suite's 2 s lease is renewed every
    # 0.7 s, which a slow turn on a busy machine may reach)
    env.update(
        CHARLIE_TEST_COMMITS_DIR=str(counts), CHARLIE_LEASE_SECONDS="60", PYTHONPATH=str(REPO)
    )
    run = [sys.executable, "-m", "charlie"]
    subprocess.run([*run, "db", "upgrade"], env=env, check=True, capture_output=True)
    with open(home / "worker.log", "wb") as log:
        proc = subprocess.Popen(
            [*run, "worker", "-c", "2", "--include", "tests.support.commits"],
            env=env, start_new_session=True, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        worker = {"env": env, "home": home, "counts": counts, "run": run}
        # one task first, so no shape pays for the pool's start
        _commits_of(worker, "warm", [{"id": "w", "name": "sleep_then", "arguments": {
            "seconds": 0, "value": "w"}}], 1)  # fmt: skip
        yield worker
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _commits_of(worker: dict[str, Any], name: str, turn: list[dict[str, Any]], turns: int) -> int:
    """The worker's commits for a task of ``turns`` such turns and a final answer."""
    script = worker["home"] / f"{name}.json"
    script.write_text(json.dumps([{"tool_calls": turn}] * turns + [{"say": "done"}]))
    time.sleep(0.3)  # every count flushed (every 0.1 s)
    before = total(str(worker["counts"]))
    done = subprocess.run(
        [*worker["run"], "submit", name, "--model", f"scripted:{script}", "--tool",
         "sleep_then", "--tool", "ledger_write", "--wait", "--timeout", "120"],
        env=worker["env"], capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
    time.sleep(0.5)  # the report's commits, flushed
    return total(str(worker["counts"])) - before


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_steady_turn_commits_as_promised(worker: dict[str, Any], shape: str) -> None:
    calls, fused, stepwise = SHAPES[shape]
    turn = [
        {"id": f"c{n}", "name": name, "arguments": arguments}
        for n, (name, arguments) in enumerate(calls)
    ]
    slug = shape.replace(" ", "-")
    short = _commits_of(worker, f"{slug}-2", turn, 2)
    long = _commits_of(worker, f"{slug}-6", turn, 6)
    per_turn = (long - short) / 4
    expected = fused if FUSED else stepwise
    assert per_turn == expected, (shape, short, long)
    k = len(calls)
    assert per_turn <= (3 if k == 1 else k + 2)
