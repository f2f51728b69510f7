"""CHARLIE_HOME is private to the user Charlie runs as (charlie.home): a fresh home made by a
real run (a `charlie submit` to the embedded broker and SQLite, a `charlie worker` that runs the
task) is 0700, and its database, the database's -wal and -shm, the broker's folders and messages
are open to nobody else, even under a umask of 000; an existing home and database open to others
are tightened, with a warning. Independent of the suite's backend: these runs use the embedded
defaults on a home of their own."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import REPO

pytestmark = [pytest.mark.timeout(150), pytest.mark.backend_free]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def embedded_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update({"CHARLIE_HOME": str(home), "PYTHONPATH": str(REPO)})
    return env


def permissive() -> None:
    os.umask(0)  # the worst umask: whatever Charlie does not make private is world-writable


def charlie(home: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "charlie", *args],
        env=embedded_env(home),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=permissive,
    )


def test_a_fresh_home_made_by_a_real_run_is_private(tmp_path: Path, script) -> None:  # type: ignore[no-untyped-def]
    model, _ = script([{"say": "private", "tool_calls": []}])
    home = tmp_path / "not-yet" / "home"
    submitted = charlie(home, "submit", "a secret prompt", "--model", model, "--task-id", "p-1")
    assert submitted.returncode == 0, submitted.stderr

    assert mode(home) == 0o700
    db = home / "charlie.db"
    queue = home / "broker" / "queue"
    messages = list(queue.iterdir())
    assert messages, "the task's message waits in the embedded broker's queue"
    for path in [db, *messages]:
        assert mode(path) & 0o077 == 0, (path, oct(mode(path)))
    for folder in (home / "broker", queue, home / "broker" / "control"):
        assert mode(folder) == 0o700, (folder, oct(mode(folder)))

    with open(tmp_path / "worker.log", "ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "charlie", "worker", "-c", "1", "-n", "private@%h"],
            env=embedded_env(home),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=permissive,
        )
    try:
        waited = charlie(home, "wait", "p-1", "--timeout", "90", timeout=120)
        assert waited.returncode == 0, (waited.stdout, (tmp_path / "worker.log").read_text())
        assert "succeeded" in waited.stdout
        state = [db, *home.glob("charlie.db-*"), *home.glob(".migrate.lock")]
        assert any(p.name == "charlie.db-wal" for p in state), state
        for path in state:
            assert mode(path) & 0o077 == 0, (path, oct(mode(path)))
        assert mode(home) == 0o700
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_an_existing_home_open_to_others_is_made_private_with_a_warning(tmp_path: Path) -> None:
    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o755)
    db = home / "charlie.db"
    db.touch()
    db.chmod(0o644)

    done = charlie(home, "db", "upgrade")
    assert done.returncode == 0, done.stderr
    assert mode(home) == 0o700 and mode(db) == 0o600
    assert f"CHARLIE_HOME {home} was open to group or others (mode 0755)" in done.stderr
    assert f"the database file {db} was open to group or others (mode 0644)" in done.stderr

    again = charlie(home, "db", "upgrade")
    assert again.returncode == 0 and "open to group or others" not in again.stderr
