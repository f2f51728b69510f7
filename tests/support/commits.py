"""Counting a worker's commits, for tests that hold Charlie to a number of commits per turn.

Imported by a worker with ``--include tests.support.commits`` (before its pool forks, so each
pool process counts from its first task) and ``CHARLIE_TEST_COMMITS_DIR`` set: each process
keeps its count in ``<dir>/<pid>`` (rewritten a few times a second). Counted as
scripts/_bench_support.py counts them: every COMMIT of a write transaction (SQLAlchemy's
``commit`` event on a connection not opened read-only) and every write statement run in
autocommit (its own transaction on the server: a fused commit, a claim). Not counted: a
transaction that wrote nothing, and the worker's presence heartbeat, which is no part of any
run.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

DIR = os.environ.get("CHARLIE_TEST_COMMITS_DIR")


class _Count:
    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.n += 1


_count = _Count()


def _presence(statement: str) -> bool:
    return "heartbeats" in statement[:80]


def _on_statement(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
    head = statement.lstrip()[:6].upper()
    if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        # (a transaction that only beats, as the presence does on SQLite, is not counted)
        if not head.startswith("BEGIN") and not _presence(statement):
            conn.info["charlie_counted"] = True
        return
    if head.startswith("SELECT") or _presence(statement):
        return
    _count.add()


def _on_commit(conn: Any) -> None:
    counted = conn.info.pop("charlie_counted", False)
    if counted and not conn.get_execution_options().get("readonly"):
        _count.add()


def _on_rollback(conn: Any) -> None:
    conn.info.pop("charlie_counted", None)


def _flush_forever() -> None:
    assert DIR is not None
    path = os.path.join(DIR, str(os.getpid()))
    tick = threading.Event()
    while not tick.wait(0.1):
        with contextlib.suppress(OSError):
            with open(f"{path}.tmp", "w") as f:
                f.write(str(_count.n))
            os.replace(f"{path}.tmp", path)


def _start() -> None:
    threading.Thread(target=_flush_forever, daemon=True).start()


def _after_fork_in_child() -> None:
    global _count
    _count = _Count()
    _start()


def total(directory: str) -> int:
    """The commits every process counted so far."""
    n = 0
    for name in os.listdir(directory):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, name)) as f:
                n += int(f.read() or 0)
    return n


if DIR:
    os.makedirs(DIR, exist_ok=True)
    event.listen(Engine, "before_cursor_execute", _on_statement)
    event.listen(Engine, "commit", _on_commit)
    event.listen(Engine, "rollback", _on_rollback)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _start()
