"""Rolling upgrades: `charlie db upgrade` while workers run tasks (charlie.store.revisions).

The release before this one is played by a copy of this package without its newest migration
(its code then needs the previous revision). With the database at that revision, workers of the
previous release run tasks; a worker of this release waits before consuming anything, and says
why in its heartbeat and in `charlie doctor`. `charlie db upgrade` runs while tasks are in
flight: none fails, the old workers keep working on the newer (additive) schema, and the new
worker starts claiming. A schema whose floor is raised past the old code stops the old workers
that run (a warm shutdown) and keeps the ones that start from claiming, saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

import charlie
from charlie.config import settings
from charlie.domain import TaskStatus
from charlie.presence import WAITING
from charlie.store.engine import get_engine, read, write
from charlie.store.heartbeats import WORKER_PREFIX, load_heartbeats
from charlie.store.revisions import code_revisions
from tests.conftest import wait_for
from tests.integration.test_production_path import charlie_cli, doctor
from tests.support.cluster import REPO, Cluster

pytestmark = pytest.mark.timeout(420)

#: each task's tool call: long enough to be in flight while the schema is upgraded
SLEEP = {"seconds": 3, "value": "slept"}


def _previous_release(tmp_path: Path) -> Path:
    """A copy of this package whose newest migration is the one before this code's."""
    root = tmp_path / "previous-release"
    shutil.copytree(
        REPO / "charlie", root / "charlie", ignore=shutil.ignore_patterns("__pycache__")
    )
    head = code_revisions()[0]
    for migration in (root / "charlie" / "store" / "migrations" / "versions").glob(f"{head}_*"):
        migration.unlink()
    return root


def _start(cluster: Cluster, root: Path, name: str) -> subprocess.Popen[bytes]:
    """A worker run from ``root``'s copy of charlie (cwd first on sys.path), the test tools
    from this repository."""
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    with open(cluster.home / f"worker-{name}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "charlie", "worker", "-c", "2", "-n", f"{name}@%h"],
            env=env,
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _submit(root: Path, cluster: Cluster, model: str, count: int) -> list[str]:
    """Tasks submitted by a producer of ``root``'s code."""
    code = (
        "import charlie\n"
        f"for _ in range({count}): print(charlie.submit('upgrade me', model={model!r}))\n"
    )
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _heartbeat(node_prefix: str) -> str | None:
    """The detail of the live worker heartbeat whose node starts with ``node_prefix``."""
    with read(get_engine(settings().database_url)) as conn:
        beats = load_heartbeats(conn)
    for name, beat in beats.items():
        if name.startswith(WORKER_PREFIX + node_prefix):
            return beat.detail or ""
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _without_the_clusters_workers(cluster: Cluster) -> Iterator[None]:
    with cluster._lock:
        cluster._terminate(cluster.workers)
        cluster.workers, kept, cluster.want_workers = [], cluster.want_workers, 0
    try:
        yield
    finally:
        with cluster._lock:
            cluster._terminate(cluster.workers)
            cluster.workers = []
            cluster.ensure(workers=kept, beat=True)


def _set_floor(revision: str | None) -> None:
    with write(get_engine(settings().database_url)) as conn:
        conn.execute(text("DELETE FROM schema_floor"))
        if revision is not None:
            conn.execute(
                text("INSERT INTO schema_floor (id, revision) VALUES (1, :r)"), {"r": revision}
            )


def test_db_upgrade_while_workers_run_tasks(cluster: Cluster, script, tmp_path: Path) -> None:
    url = settings().database_url
    if url.startswith("sqlite"):
        pytest.skip("the embedded database is migrated by its worker (rolling upgrades: servers)")
    from alembic import command

    from charlie.store.alembic_config import alembic_config

    head, previous = code_revisions()[:2]
    old = _previous_release(tmp_path)
    env = cluster.settings_env
    mine: list[subprocess.Popen[bytes]] = []
    with _without_the_clusters_workers(cluster):
        try:
            command.downgrade(alembic_config(url), previous)
            # Workers of the previous release, and one of this one.
            mine += [_start(cluster, old, "old1"), _start(cluster, old, "old2")]
            new = cluster.start_worker()
            new_node = f"w{cluster._serial}@"
            waiting = wait_for(
                lambda: (_heartbeat(new_node) or "").startswith(WAITING) and _heartbeat(new_node),
                timeout=90,
                interval=0.5,
            )
            assert f"schema at {previous}" in waiting and "charlie db upgrade" in waiting
            wait_for(lambda: _heartbeat("old1@") and _heartbeat("old2@"), 90, 0.5)
            _, checks = doctor(env)
            assert checks["schema"]["status"] == "FAIL", checks["schema"]
            assert f"at revision {previous}, head is {head}" in checks["schema"]["detail"]
            assert checks["workers"]["status"] == "WARN", checks["workers"]
            assert "1 waiting" in checks["workers"]["detail"]

            # Tasks in flight (each sleeps in a tool) while the schema is upgraded.
            model, _ = script(
                [
                    {"tool_calls": [{"id": "s", "name": "sleep_then", "arguments": SLEEP}]},
                    {"say": "upgraded under me"},
                ]
            )
            first = _submit(old, cluster, model, 6)
            upgraded = charlie_cli(env, "db", "upgrade", timeout=120)
            assert upgraded.returncode == 0, upgraded.stderr
            # The new worker claims work now; the old ones keep working on the newer schema.
            wait_for(lambda: not (_heartbeat(new_node) or WAITING).startswith(WAITING), 30, 0.5)
            for task_id in first:
                info = charlie.wait(task_id, timeout=120)
                assert info.status is TaskStatus.SUCCEEDED, (task_id, info.status, info.error)
            assert all(p.poll() is None for p in mine), "an old worker stopped"

            # Only the new worker and one old one; tasks from a producer of this release.
            _stop(mine[0])
            later = [charlie.submit("after the upgrade", model=model) for _ in range(3)]
            for task_id in later:
                assert charlie.wait(task_id, timeout=120).status is TaskStatus.SUCCEEDED

            # A contract migration raises the floor past the old code: the old worker that runs
            # stops (warm), and one that starts waits, saying why.
            _set_floor(head)
            mine[1].wait(timeout=60)
            old_log = (cluster.home / "worker-old2.log").read_text()
            assert "no longer fits the database" in old_log
            mine.append(_start(cluster, old, "old3"))
            refused = wait_for(
                lambda: (_heartbeat("old3@") or "").startswith(WAITING) and _heartbeat("old3@"),
                timeout=90,
                interval=0.5,
            )
            assert f"needs code at revision {head} or newer" in refused
            assert f"this code is at {previous}" in refused
            assert new.poll() is None, "the new worker kept running"
        finally:
            for proc in mine:
                if proc.poll() is None:
                    _stop(proc)
            command.upgrade(alembic_config(url), "head")
            _set_floor(None)
