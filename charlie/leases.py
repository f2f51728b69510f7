"""Lease heartbeats: who is working on a run or a call, renewed while the work lasts (I5).

A killed worker stops renewing, so its lease lapses within the lease period and the sweep can
reclaim the work. Renewal is a compare-and-set on the owner: once another worker has taken the
lease over, renewing stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine

from charlie.store.engine import write

log = logging.getLogger("charlie.lease")


@contextmanager
def heartbeat(
    engine: Engine, renew: Callable[[Connection], bool], interval: float, name: str
) -> Iterator[None]:
    """Run ``renew`` in its own short transaction every ``interval`` seconds until the block
    ends, or until it returns False (the lease is no longer ours)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            try:
                with write(engine) as conn:
                    if not renew(conn):
                        return
            except Exception:
                log.warning("lease heartbeat failed", exc_info=True, extra={"lease": name})

    thread = threading.Thread(target=beat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
