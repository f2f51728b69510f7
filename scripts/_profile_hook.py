"""Loaded into a profiled worker (``--include _profile_hook``; scripts/profile_turn.py): a
cProfile of the worker's main thread, counting CPU time (``time.process_time``, so a loaded
machine's waiting is not counted), switched by a control file the driver writes; and, on
PostgreSQL, libpq's trace of every message the worker's connections send and receive.

At each task's prerun (a solo pool runs tasks, and consumes and publishes, in the main thread):
``PROFILE_CTL`` reading ``on`` starts the profile; ``off`` stops it and writes its stats to
``PROFILE_OUT`` (pstats' format). ``trace`` starts the trace: each pooled connection checked
out from then on writes its messages to a file of its own, ``PROFILE_OUT.trace.<n>``; any other
word stops it, each connection at its next checkout (libpq flushes a trace when it stops).
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path
from typing import IO, Any

from celery.signals import task_prerun
from sqlalchemy import event
from sqlalchemy.engine import Engine

_CTL = os.environ.get("PROFILE_CTL")
_OUT = os.environ.get("PROFILE_OUT")
_profile: cProfile.Profile | None = None
_tracing = False
#: the traced DBAPI connections, by id: (the connection, its trace file)
_traced: dict[int, tuple[Any, IO[str]]] = {}
_trace_files = 0


def _switch(**_: Any) -> None:
    global _profile, _tracing
    if not _CTL or not _OUT:
        return
    try:
        wanted = Path(_CTL).read_text().strip()
    except OSError:
        return
    _tracing = wanted == "trace"
    if wanted == "on" and _profile is None:
        _profile = cProfile.Profile(time.process_time)
        _profile.enable()
    elif wanted == "off" and _profile is not None:
        _profile.disable()
        _profile.dump_stats(_OUT + ".part")
        os.replace(_OUT + ".part", _OUT)
        _profile = None


def _trace(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    global _trace_files
    pgconn = getattr(dbapi_conn, "pgconn", None)  # psycopg 3 only
    if pgconn is None or not _OUT:
        return
    traced = _traced.get(id(dbapi_conn))
    if _tracing and traced is None:
        from psycopg import pq

        _trace_files += 1
        file = open(f"{_OUT}.trace.{_trace_files}", "w")  # noqa: SIM115
        pgconn.trace(file.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        _traced[id(dbapi_conn)] = (dbapi_conn, file)
    elif not _tracing and traced is not None:
        pgconn.untrace()
        traced[1].close()
        del _traced[id(dbapi_conn)]


task_prerun.connect(_switch, weak=False)
if os.environ.get("PROFILE_TRACE"):
    event.listen(Engine, "checkout", _trace)
