"""A worker's presence in the database: a heartbeat every few seconds from its main process,
naming the queues it consumes, so `charlie doctor` sees live workers on any broker, with or
without Celery's remote control."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from charlie.domain import utcnow
from charlie.store.engine import read, write_one
from charlie.store.heartbeats import (
    SETTLE_WAKES_PREFIX,
    WORKER_PREFIX,
    Heartbeat,
    forget_heartbeat,
    record_heartbeat,
)
from charlie.store.revisions import SchemaCheck, SchemaFit, check_schema
from charlie.store.types import Engine

log = logging.getLogger("charlie.presence")

#: how often a worker says it is alive; doctor counts one silent for 6 times this as gone.
EVERY = 10.0

#: how often a worker that waits for the schema to fit its code looks again
SCHEMA_POLL = 2.0

#: a worker's connection budget is a heartbeat of this name, then its node (detail: how many)
BUDGET_PREFIX = "connections:"

#: a worker's pool is a heartbeat of this name, then its node (detail: pool_detail's JSON)
POOL_PREFIX = "pool:"

#: a waiting worker's heartbeat detail starts with this, then why (doctor shows it)
WAITING = "waiting: "


def schema_fit(engine: Engine) -> SchemaCheck:
    with read(engine) as conn:
        return check_schema(conn)


def wait_until_schema_fits(engine: Engine, node: str, stop: threading.Event) -> SchemaCheck | None:
    """Block a starting worker, before it consumes anything, until its code fits the
    database's schema (charlie.store.revisions): a worker newer than the schema waits for
    `charlie db upgrade`; one older than the schema's floor waits for its own upgrade. Meanwhile
    its heartbeat says why (`charlie doctor` lists it as waiting). None: ``stop`` was set."""
    name = WORKER_PREFIX + node
    said = None
    while not stop.is_set():
        try:
            fit = schema_fit(engine)
        except Exception as error:  # the database away for a while: say so, try again
            log.warning("cannot read the database's schema revision: %s", error)
            stop.wait(SCHEMA_POLL)
            continue
        if fit.can_claim:
            if fit.fit is SchemaFit.NEWER_COMPATIBLE:
                log.info("%s", fit.why)
            if said is not None:
                log.warning("the schema fits this worker's code now: claiming work")
            return fit
        if fit.why != said:
            log.error("this worker claims no work: %s", fit.why)
            said = fit.why
        try:
            with write_one(engine) as conn:
                record_heartbeat(conn, name, node, utcnow(), WAITING + fit.why)
        except Exception:
            log.debug("could not record the waiting worker's heartbeat", exc_info=True)
        stop.wait(SCHEMA_POLL)
    return None


def pool_detail(pool: str, concurrency: int, in_flight: int, peak: int, counts: str) -> str:
    """A worker's pool heartbeat: its pool and concurrency, and what it had in flight at the
    beat and at most since the last one (``counts``: "model calls", or "tasks" where the main
    process cannot see its children's calls)."""
    return json.dumps(
        {
            "pool": pool,
            "concurrency": concurrency,
            "in_flight": in_flight,
            "peak": peak,
            "counts": counts,
        },
        sort_keys=True,
    )


def read_pool_detail(detail: str | None) -> dict[str, Any] | None:
    """pool_detail's fields, or None from a detail that is not one (an earlier release's)."""
    try:
        fields = json.loads(detail or "")
    except ValueError:
        return None
    return fields if isinstance(fields, dict) and "pool" in fields else None


def live_pools(beats: Mapping[str, Heartbeat], now: datetime) -> list[tuple[str, dict[str, Any]]]:
    """(node, pool_detail's fields) of each worker alive at ``now`` (a heartbeat within 6
    EVERY, not waiting for the schema) whose pool heartbeat says one, by node."""
    alive = {
        name.removeprefix(WORKER_PREFIX)
        for name, beat in beats.items()
        if name.startswith(WORKER_PREFIX)
        and (now - beat.at).total_seconds() <= 6 * EVERY
        and not (beat.detail or "").startswith(WAITING)
    }
    found = []
    for name, beat in sorted(beats.items()):
        node = name.removeprefix(POOL_PREFIX)
        fields = read_pool_detail(beat.detail) if name.startswith(POOL_PREFIX) else None
        if fields is not None and node in alive:
            found.append((node, fields))
    return found


#: a worker's pool as a heartbeat reports it: (pool, concurrency, in flight, peak, counts)
PoolReport = Callable[[], tuple[str, int, int, int, str]]


class Presence:
    """A worker's heartbeat, every EVERY seconds; each also checks that the schema still fits
    the worker's code (a `charlie db upgrade` may have raised its floor past this code) and
    calls ``on_unfit`` with why when it does not."""

    def __init__(
        self,
        engine: Engine,
        node: str,
        queues: Iterable[str],
        on_unfit: Callable[[SchemaCheck], object] | None = None,
        connections: int | None = None,
        pool: PoolReport | None = None,
    ) -> None:
        self.engine = engine
        self.name = WORKER_PREFIX + node
        self.node = node
        self.detail = ",".join(sorted(queues))
        self.on_unfit = on_unfit
        #: the most database connections this worker's processes may hold (doctor adds them up)
        self.connections = connections
        #: what the worker's pool is and has in flight, at each beat (doctor, the console)
        self.pool = pool
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="charlie-presence", daemon=True)

    def start(self) -> Presence:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            with write_one(self.engine) as conn:
                forget_heartbeat(conn, self.name)
                forget_heartbeat(conn, BUDGET_PREFIX + self.node)
                forget_heartbeat(conn, POOL_PREFIX + self.node)
                forget_heartbeat(conn, SETTLE_WAKES_PREFIX + self.node)
        except Exception:
            log.warning("could not clear the worker's heartbeat", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with write_one(self.engine) as conn:
                    now = utcnow()
                    # first: a worker row is never seen without it (sweeps' probe, I4)
                    record_heartbeat(conn, SETTLE_WAKES_PREFIX + self.node, self.node, now)
                    record_heartbeat(conn, self.name, self.node, now, self.detail)
                    if self.connections is not None:
                        record_heartbeat(
                            conn, BUDGET_PREFIX + self.node, self.node, now, str(self.connections)
                        )
                    if self.pool is not None:
                        detail = pool_detail(*self.pool())
                        record_heartbeat(conn, POOL_PREFIX + self.node, self.node, now, detail)
            except Exception:  # the database away for a while: say so, keep beating
                log.warning("could not record the worker's heartbeat", exc_info=True)
            if self.on_unfit is not None:
                self._check_schema()
            self._stop.wait(max(0.0, EVERY - (time.monotonic() - started)))

    def _check_schema(self) -> None:
        try:
            fit = schema_fit(self.engine)
        except Exception:
            log.warning("could not read the database's schema revision", exc_info=True)
            return
        if not fit.can_claim and self.on_unfit is not None:
            log.error("this worker's code no longer fits the schema: %s", fit.why)
            on_unfit, self.on_unfit = self.on_unfit, None  # once: it stops the worker
            on_unfit(fit)
