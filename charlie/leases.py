"""Lease heartbeats: who is working on a run or a call, renewed while the work lasts (I5).

A killed worker stops renewing, so its lease lapses within the lease period and the sweep can
reclaim the work. Renewal is a compare-and-set on the owner (and, for a call, the attempt it was
taken under): once another worker has taken the lease over, renewing stops and the holder is
told (``Held.lost``), so a live worker whose lease lapsed (a pause, long lock waits) stops acting
for work that is no longer its own.

One keeper thread per process renews every lease its work holds. Most work (an instant tool, a
fast model) ends long before its first renewal is due, so holding a lease costs a dictionary
entry, not a thread started and joined for each model call and each tool call.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from charlie.store.engine import write
from charlie.store.types import Connection, Engine

log = logging.getLogger("charlie.lease")

Renew = Callable[[Connection], bool]

#: the share of a lease a holder trusts by its own clock, after the claim or a renewal.
TRUSTED_SHARE = 1 / 3


@dataclass
class _Lease:
    renew: Renew
    interval: float
    due: float
    name: str
    held: Held


class Held:
    """One lease as its holder sees it: ``lost`` is set once a renewal matched no row (another
    worker took the work over, or it was settled), and ``confirm()`` says, before an
    irreversible step, whether the lease is still this holder's."""

    def __init__(self, keeper: LeaseKeeper, renew: Renew, seconds: float | None) -> None:
        self.lost = threading.Event()
        self._keeper = keeper
        self._renew = renew
        # Trusted without asking for a third of the lease only: the lease was written by the
        # claim a moment before this object exists, and the sweeper judges it by its own clock;
        # the margin covers both (renewals come every third of the lease, so a holder in
        # steady work still never asks).
        self._seconds = None if seconds is None else seconds * TRUSTED_SHARE
        self._valid_until = time.monotonic() + (self._seconds or 0.0)

    def renewed(self, at: float) -> None:
        if self._seconds is not None:
            self._valid_until = at + self._seconds

    def confirm(self) -> bool:
        """True while the lease is this holder's. Within the lease period of the last renewal,
        by this process's clock, that is known without asking; past it (the process was paused,
        or renewals failed) one renewal decides. A renewal that cannot be made (the database is
        unreachable) is not a confirmation."""
        if self.lost.is_set():
            return False
        if self._seconds is not None and time.monotonic() < self._valid_until:
            return True
        at = time.monotonic()
        try:
            with write(self._keeper.engine) as conn:
                held = self._renew(conn)
        except Exception:
            log.warning("lease confirmation failed", exc_info=True)
            return False
        if not held:
            self.lost.set()
            return False
        self.renewed(at)
        return True


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
        #: when the keeper wakes next by itself (-inf: it is awake and looks again before it
        #: sleeps). A new lease due later needs no notify: waking the keeper for nothing costs
        #: a thread switch on every model and tool call, most of which end before it is due.
        self._wakes_at = -math.inf
        #: how long an idle keeper sleeps: the shortest renewal interval it has seen, so a new
        #: lease (due an interval from now) is never due before the keeper's next look
        self._idle_wait = math.inf

    @contextmanager
    def held(
        self, renew: Renew, interval: float, name: str, lease_seconds: float | None = None
    ) -> Iterator[Held]:
        """Keep the lease renewed while the block runs. ``lease_seconds``: how long a renewal
        holds it, for ``Held.confirm`` to know without asking."""
        key = next(self._ids)
        held = Held(self, renew, lease_seconds)
        with self._changed:
            due = time.monotonic() + interval
            self._leases[key] = _Lease(renew, interval, due, name, held)
            self._idle_wait = min(self._idle_wait, interval)
            self._ensure_thread()
            if due < self._wakes_at:
                self._changed.notify()
        try:
            yield held
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
                    wait = self._idle_wait if wake is None else wake - now
                    self._wakes_at = now + wait
                    self._changed.wait(None if math.isinf(wait) else wait)
                    self._wakes_at = -math.inf
                    continue
                for _key, lease in due:
                    lease.due = now + lease.interval
            for key, lease in due:
                if not self._renew(lease):
                    lease.held.lost.set()
                    log.warning("lease lost", extra={"lease": lease.name})
                    with self._changed:
                        self._leases.pop(key, None)

    def _renew(self, lease: _Lease) -> bool:
        at = time.monotonic()
        try:
            with write(self.engine) as conn:
                held = lease.renew(conn)
            if held:
                lease.held.renewed(at)
            return held
        except Exception:
            # Keep trying: a renewal that fails now may succeed before the lease lapses.
            log.warning("lease heartbeat failed", exc_info=True, extra={"lease": lease.name})
            return True


__all__ = ["Held", "LeaseKeeper", "Renew"]
