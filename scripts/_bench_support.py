"""Loaded into Charlie's benchmark workers through ``CHARLIE_TOOL_MODULES=_bench_support``.

It registers the benchmark's instant tool and, when ``BENCH_STATS_DIR`` is set, counts in every
worker process the Celery tasks it ran and the SQL statements it sent (an SQLAlchemy
``before_cursor_execute`` listener on every engine), by task name. Each process rewrites
``BENCH_STATS_DIR/<pid>.json`` a few times a second, so ``scripts/bench.py`` can take snapshots
and difference them, even across a worker that was SIGKILLed.

Counted: statements that go through a cursor (SQLite's ``BEGIN IMMEDIATE`` included); not
counted: the driver's implicit BEGIN and COMMIT, and the ping of a connection that sat idle.
Only worker processes count (not ``charlie beat``, whose sweeps are no part of the loop), and
not a worker's presence heartbeat (``heartbeats``, every 10 s) either.
Commits: every write transaction's COMMIT (an SQLAlchemy ``commit`` event on a
connection not opened read-only) and every write statement run in autocommit (its own
transaction on the server, as a slow phase's claim is on PostgreSQL).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import Any

from celery.signals import task_postrun, task_prerun
from sqlalchemy import event
from sqlalchemy.engine import Engine

from charlie.tools import tool


@tool(effect="read", deadline=60, threadsafe=True)
def bench_echo(value: str = "") -> str:
    """Return ``value`` at once: the benchmark's instant tool."""
    return value


@tool(effect="read", deadline=60, threadsafe=True)
def bench_page(size: int = 4096) -> str:
    """Return ``size`` characters of text at once: the long run's tool result."""
    line = "the quick brown fox jumps over the lazy dog, page after page of it\n"
    return (line * (size // len(line) + 1))[:size]


STATS_DIR = os.environ.get("BENCH_STATS_DIR")
FLUSH_SECONDS = 0.5
OUTSIDE_TASKS = "-"


class _Counter:
    """Per-process counts: task name -> [tasks run, statements sent, commits].

    A prefork child runs one task at a time, so the task running now is process-wide: the
    statements of a lease heartbeat thread count for the task whose lease it renews."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, list[int]] = {}
        self.current = OUTSIDE_TASKS
        self.dirty = False

    def task_started(self, name: str) -> None:
        self.current = name
        with self.lock:
            self.counts.setdefault(name, [0, 0, 0])[0] += 1
            self.dirty = True

    def task_finished(self) -> None:
        self.current = OUTSIDE_TASKS

    def statement(self, commits: int = 0) -> None:
        with self.lock:
            entry = self.counts.setdefault(self.current, [0, 0, 0])
            entry[1] += 1
            entry[2] += commits
            self.dirty = True

    def commit(self) -> None:
        with self.lock:
            self.counts.setdefault(self.current, [0, 0, 0])[2] += 1
            self.dirty = True

    def flush(self) -> None:
        assert STATS_DIR is not None
        with self.lock:
            if not self.dirty:
                return
            doc = json.dumps({"pid": os.getpid(), "counts": self.counts})
            self.dirty = False
        path = os.path.join(STATS_DIR, f"{os.getpid()}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(doc)
        os.replace(tmp, path)


_counter = _Counter()


def _on_prerun(task: Any = None, **_: Any) -> None:
    _counter.task_started(getattr(task, "name", None) or "?")


def _on_postrun(**_: Any) -> None:
    _counter.task_finished()


def _on_statement(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
    autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    if "heartbeats" in statement[:80]:
        # the worker's presence (every 10 s, whatever it runs): no part of the loop
        if not autocommit:
            conn.info["bench_presence"] = True
        return
    writes = autocommit and not statement.lstrip()[:6].upper().startswith("SELECT")
    _counter.statement(1 if writes else 0)


def _on_commit(conn: Any) -> None:
    presence = conn.info.pop("bench_presence", False)
    if not presence and not conn.get_execution_options().get("readonly"):
        _counter.commit()


def _on_rollback(conn: Any) -> None:
    conn.info.pop("bench_presence", None)


def _flush_forever(counter: _Counter) -> None:
    tick = threading.Event()
    while not tick.wait(FLUSH_SECONDS):
        with contextlib.suppress(OSError):
            counter.flush()


def _start_flusher() -> None:
    flusher = threading.Thread(target=_flush_forever, args=(_counter,), daemon=True)
    flusher.start()


def _after_fork_in_child() -> None:
    # A child forked after this module was imported starts from zero, under its own pid.
    global _counter
    _counter = _Counter()
    _start_flusher()


# Workers only: `charlie beat` imports the tool modules too, and its sweeps (every second,
# idle runs or not) are not the loop's statements; counted, they were spread over the turns
# of whatever run the window held.
_IN_WORKER = "worker" in sys.argv[1:3]

if STATS_DIR and _IN_WORKER:
    os.makedirs(STATS_DIR, exist_ok=True)
    task_prerun.connect(_on_prerun, weak=False)
    task_postrun.connect(_on_postrun, weak=False)
    event.listen(Engine, "before_cursor_execute", _on_statement)
    event.listen(Engine, "commit", _on_commit)
    event.listen(Engine, "rollback", _on_rollback)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _start_flusher()
