"""Lease heartbeats: who is working on a run or a call, renewed while the work lasts (I5).

A killed worker stops renewing, so its lease lapses within the lease period and the sweep can
reclaim the work. Renewal is a compare-and-set on the owner: once another worker has taken the
lease over, renewing stops.

One keeper thread per process renews every lease its work holds. Most work (an instant tool, a
fast model) ends long before its first renewal is due, so holding a lease costs a dictionary
entry, not a thread started and joined for each model call and each tool call.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Connection, Engine

from charlie.store.engine import write

log = logging.getLogger("charlie.lease")

Renew = Callable[[Connection], bool]


@dataclass
class _Lease:
    renew: Renew
    interval: float
    due: float
    name: str


class LeaseKeeper:
    """Renews the registered leases, each every ``interval`` seconds, in its own short
    transaction, until it is released or its renewal reports it lost."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = 0

    @contextmanager
    def held(self, renew: Renew, interval: float, name: str) -> Iterator[None]:
        """Keep the lease renewed while the block runs."""
        key = next(self._ids)
        with self._changed:
            self._leases[key] = _Lease(renew, interval, time.monotonic() + interval, name)
            self._ensure_thread()
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._leases.pop(key, None)

    def _ensure_thread(self) -> None:
        # A forked pool child inherits the object but not the thread.
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                now = time.monotonic()
                due = [(k, lease) for k, lease in self._leases.items() if lease.due <= now]
                if not due:
                    wake = min((lease.due for lease in self._leases.values()), default=None)
                    self._changed.wait(None if wake is None else wake - now)
                    continue
                for _key, lease in due:
                    lease.due = now + lease.interval
            for key, lease in due:
                if not self._renew(lease):
                    with self._changed:
                        self._leases.pop(key, None)

    def _renew(self, lease: _Lease) -> bool:
        try:
            with write(self.engine) as conn:
                return lease.renew(conn)
        except Exception:
            # Keep trying: a renewal that fails now may succeed before the lease lapses.
            log.warning("lease heartbeat failed", exc_info=True, extra={"lease": lease.name})
            return True


__all__ = ["LeaseKeeper", "Renew"]
