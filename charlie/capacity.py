"""The provider limits the fleet keeps, as the phases' CapacityPort (I30).

Before a limited model call, one short transaction locks the limit's row, counts what is in
flight, sent in the last minute and waiting ahead, and either takes a slot or records the run
as a waiter; the call_model phase then waits with a stored wake-up, holding no worker and no
lease. After the call, another releases the slot (its tokens corrected by the reported usage)
and publishes the tick of the next waiter in line, so a freed slot is taken at once rather than
at the next sweep. A provider's 429 (or 529) pauses every caller of the limit, fleet-wide.
Nothing is held across the model call: the slot's liveness is its run's lease (store.limits).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

from charlie.domain import RunView, utcnow
from charlie.limits import (
    LimitTable,
    decide,
    estimate_tokens,
    limit_for,
    look_again_after,
    stale_after,
)
from charlie.models.base import ModelRequest, Usage
from charlie.models.retry import retry_after_max
from charlie.observe import NOOP, Observer, safely
from charlie.ports import CapacitySlot, CapacityWait
from charlie.store import limits as store
from charlie.store.engine import write, write_one
from charlie.store.types import Connection, Engine

log = logging.getLogger("charlie.capacity")


def request_size(request: ModelRequest) -> int:
    """The characters a request sends: what its tokens are estimated from."""
    items = sum(len(json.dumps(item.payload, default=str)) for item in request.items)
    return items + len(json.dumps(request.tools, default=str))


class FleetLimits:
    """The CapacityPort over the database every worker shares."""

    def __init__(
        self,
        engine: Engine,
        table: LimitTable,
        wake: Callable[[str, int, int], object],
        lease_seconds: float,
        stall_seconds: float,
        observer: Callable[[], Observer] = lambda: NOOP,
    ) -> None:
        self.engine = engine
        #: this process's telemetry, as it is when a call is made (installed after start)
        self.observer = observer
        self.table = table
        self.wake = wake
        #: the runs this process woke (handed_over), for it to run once its tick is done
        self._handed: list[tuple[str, int]] = []
        #: the runs whose waits this process wrote, until its tick is done: one a release woke
        #: while it still held its lease is run again then (handed_over)
        self._waited: list[str] = []
        self._lock = threading.Lock()
        self.fallback = look_again_after(lease_seconds)
        self.stale = stale_after(lease_seconds, stall_seconds)
        #: a waiter woken this recently is not woken again: the next release wakes the next
        self.woken_grace = timedelta(seconds=max(1.0, lease_seconds / 2))

    def acquire(
        self, view: RunView, model: str, request: ModelRequest
    ) -> CapacitySlot | CapacityWait | None:
        limit = limit_for(model, self.table)
        if limit is None:
            return None
        tokens = estimate_tokens(request_size(request)) if limit.tpm is not None else 0
        # First a look without the limit's lock: a call that has to wait (most of them, when
        # many wait) records itself as a waiter without holding the lock every grant takes.
        woken: list[store.Woken] = []
        with write_one(self.engine) as conn:
            now = utcnow()
            counted, priority, since = store.count(
                conn, limit.key, view.execution_id, view.task.id, now, self.woken_grace
            )
            verdict = decide(limit, counted, tokens, self.fallback)
            if verdict.wake_at is not None:
                self._wait(conn, limit.key, view, verdict.wake_at, priority, since, now)
                # Room is free while the callers ahead sleep: wake them to use it.
                woken = store.next_in_line(
                    conn, limit.key, now, verdict.wake_ahead, self.woken_grace, view.execution_id
                )
        slot: CapacitySlot | None = None
        if verdict.wake_at is None:
            # It may go: look again holding the lock, so no two callers take one slot.
            with write(self.engine) as conn:
                now = utcnow()
                store.lock_limit(conn, limit.key)
                counted, priority, since = store.count(
                    conn, limit.key, view.execution_id, view.task.id, now, self.woken_grace
                )
                verdict = decide(limit, counted, tokens, self.fallback)
                if verdict.wake_at is None:
                    slot_id = store.take_slot(
                        conn,
                        limit.key,
                        view.execution_id,
                        view.version,
                        view.attempts,
                        tokens,
                        now,
                        waited=since is not None,
                    )
                    slot = CapacitySlot(limit.key, slot_id, tokens)
                else:
                    self._wait(conn, limit.key, view, verdict.wake_at, priority, since, now)
        if verdict.wake_at is not None:
            for waiter in woken:
                self.wake(waiter.execution_id, waiter.version, waiter.priority)
            # This process is free once its own wait is written: it runs them next, as it does
            # those a release wakes, rather than leave the room idle while their ticks cross
            # the queue.
            with self._lock:
                self._handed.extend((w.execution_id, w.version) for w in woken)
                self._waited.append(view.execution_id)
        observer = self.observer()
        if slot is not None:
            if observer.enabled:
                safely(observer.model_limit, limit.key, "granted")
            return slot
        assert verdict.wake_at is not None
        if observer.enabled:
            safely(observer.model_limit, limit.key, "waited")
        log.info(
            "model call waits for capacity on %s (%s)",
            limit.key,
            verdict.reason,
            extra={"execution_id": view.execution_id, "wake_at": verdict.wake_at.isoformat()},
        )
        return CapacityWait(
            limit.key, verdict.wake_at, verdict.reason, counted.in_flight, counted.waiting + 1
        )

    def _wait(
        self,
        conn: Connection,
        key: str,
        view: RunView,
        wake_at: datetime,
        priority: int,
        since: datetime | None,
        now: datetime,
    ) -> None:
        expires = wake_at + self.stale
        store.wait(conn, key, view.execution_id, view.version, priority, since, now, expires)

    def release(self, slot: CapacitySlot | None, usage: Usage | None) -> None:
        if slot is None:
            return
        tokens = None if usage is None else usage.input_tokens + usage.output_tokens
        try:
            # Each statement on its own (autocommit on a server database): what they do is
            # idempotent, and a waiter two releases both pick is woken twice (one tick stale).
            with write_one(self.engine) as conn:
                woken = store.release(
                    conn,
                    slot.limit,
                    slot.slot_id,
                    tokens,
                    utcnow(),
                    wake=1,
                    woken_grace=self.woken_grace,
                )
        except Exception:
            # Not released, the slot still lapses with the run's lease or its next claim
            # (store.limits: a slot's liveness is its run's lease); the waiters' own wake-ups
            # stand.
            log.exception("could not release a slot of %s", slot.limit)
            return
        for waiter in woken:
            self.wake(waiter.execution_id, waiter.version, waiter.priority)
        with self._lock:
            self._handed.extend((w.execution_id, w.version) for w in woken)

    def leave(self, view: RunView) -> None:
        """The run's wait for capacity ended without a slot (its task canceled, stopped, over
        budget, or its call failed): its place in line ends, and the room a release may have
        woken it for is passed on to the next in line (I30)."""
        try:
            with write_one(self.engine) as conn:
                woken = store.leave(conn, view.execution_id, utcnow(), self.woken_grace)
        except Exception:
            # Its row expires by itself, and the waiters' own wake-ups stand.
            log.exception("could not end the wait of %s", view.execution_id)
            return
        for waiter in woken:
            self.wake(waiter.execution_id, waiter.version, waiter.priority)
        with self._lock:
            self._handed.extend((w.execution_id, w.version) for w in woken)

    def handed_over(self) -> list[tuple[str, int]]:
        with self._lock:
            handed, self._handed = self._handed, []
            waited, self._waited = self._waited, []
        if waited:
            # A release that found one of them still holding its lease (its wait not yet
            # committed) woke it all the same: its wait is over, it looks again now.
            try:
                with write_one(self.engine) as conn:
                    woken = store.woken_while_leased(conn, waited, utcnow())
            except Exception:
                log.exception("could not look for waits woken meanwhile")
                woken = []
            handed += [(w.execution_id, w.version) for w in woken]
        return handed

    def throttled(self, slot: CapacitySlot, seconds: float) -> None:
        # never longer than CHARLIE_MODEL_RETRY_AFTER_MAX, whatever a client passed (I36)
        cap = retry_after_max()
        seconds = min(seconds, cap) if seconds == seconds else cap
        until = utcnow() + timedelta(seconds=max(0.0, seconds))
        log.warning(
            "the provider of %s asked to wait %.1f s: every caller of the limit waits",
            slot.limit,
            seconds,
        )
        observer = self.observer()
        if observer.enabled:
            safely(observer.model_limit, slot.limit, "throttled")
        try:
            with write(self.engine) as conn:
                store.pause(conn, slot.limit, until)
        except Exception:
            log.exception("could not record the pause of %s", slot.limit)
