"""A worker's presence in the database: a heartbeat every few seconds from its main process,
naming the queues it consumes, so `charlie doctor` sees live workers on any broker, with or
without Celery's remote control."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from charlie.domain import utcnow
from charlie.store.engine import write_one
from charlie.store.heartbeats import WORKER_PREFIX, forget_heartbeat, record_heartbeat
from charlie.store.types import Engine

log = logging.getLogger("charlie.presence")

#: how often a worker says it is alive; doctor counts one silent for 6 times this as gone.
EVERY = 10.0


class Presence:
    def __init__(self, engine: Engine, node: str, queues: Iterable[str]) -> None:
        self.engine = engine
        self.name = WORKER_PREFIX + node
        self.node = node
        self.detail = ",".join(sorted(queues))
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
        except Exception:
            log.warning("could not clear the worker's heartbeat", exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with write_one(self.engine) as conn:
                    record_heartbeat(conn, self.name, self.node, utcnow(), self.detail)
            except Exception:  # the database away for a while: say so, keep beating
                log.warning("could not record the worker's heartbeat", exc_info=True)
            self._stop.wait(EVERY)
