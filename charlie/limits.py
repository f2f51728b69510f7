"""Provider limits the whole fleet keeps: what is declared, and what a call may do under it.
Pure: no SQL, no settings read here; callers pass the table and what the store counted.

``CHARLIE_MODEL_LIMITS`` (the JSON object inline, or the path of a JSON file) maps a model spec,
or a prefix of specs, to the limits of the provider account behind it::

    {"openai:": {"concurrency": 4, "rpm": 600},
     "anthropic:claude-": {"concurrency": 2, "tpm": 400000}}

``concurrency`` is requests in flight, ``rpm`` requests per minute, ``tpm`` tokens per minute
(estimated from a call's input before it is sent, corrected by the usage the provider reports).
A spec is kept by its exact entry, else by the longest key that is a prefix of it and ends at a
separator (``: / - . _ @``), as ``CHARLIE_PRICES`` is looked up; every spec a key covers shares
that key's limits (one account). A model no key covers has no limit and costs nothing more.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from charlie.jsonsetting import json_object

LIMITS_SETTING = "CHARLIE_MODEL_LIMITS"
#: what a limits key may end at to be a prefix of specs (as a price table's).
SEPARATORS = frozenset(":/-._@")
LIMIT_KEYS = ("concurrency", "rpm", "tpm")
#: the window rpm and tpm are counted over: a minute, and a second more. A request counts for
#: that long from when its slot was taken and from when it ended (store.limits): the provider
#: counts it from its arrival, between the two.
WINDOW = timedelta(seconds=61)
#: a caller far back in line looks again by itself after at most this many leases
MAX_ROUNDS = 12
#: roughly how many characters of a request make one token (the estimate before the call).
CHARS_PER_TOKEN = 4


class LimitsError(ValueError):
    """CHARLIE_MODEL_LIMITS cannot be read or is not a table of limits."""


@dataclass(frozen=True)
class Limit:
    """One account's limits; None: not limited that way."""

    key: str
    concurrency: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    def describe(self) -> str:
        parts = [
            f"{n} {what}"
            for n, what in (
                (self.concurrency, "in flight"),
                (self.rpm, "requests/min"),
                (self.tpm, "tokens/min"),
            )
            if n is not None
        ]
        return ", ".join(parts) or "no limit"


LimitTable = dict[str, Limit]


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LimitsError(f"{LIMITS_SETTING}: {where} must be a whole number, got {value!r}")
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise LimitsError(f"{LIMITS_SETTING}: {where} must be a whole number of 1 or more")
    return int(value)


def parse_limits(raw: str | None) -> LimitTable:
    """The limits of a ``CHARLIE_MODEL_LIMITS`` value (inline JSON, or a JSON file's path); a
    LimitsError naming the setting when it cannot be used."""
    if raw is None or not raw.strip():
        return {}
    data = json_object(LIMITS_SETTING, raw, LimitsError, "model: limits")
    table: LimitTable = {}
    for key, entry in data.items():
        if not key:
            raise LimitsError(f"{LIMITS_SETTING}: a model key is empty")
        if not isinstance(entry, dict) or not entry:
            raise LimitsError(
                f'{LIMITS_SETTING}: {key!r} must be an object like {{"concurrency": 4, '
                '"rpm": 600, "tpm": 200000}'
            )
        unknown = sorted(set(entry) - set(LIMIT_KEYS))
        if unknown:
            raise LimitsError(
                f"{LIMITS_SETTING}: {key!r} has unknown key(s) {', '.join(unknown)}; "
                "the keys are concurrency, rpm and tpm"
            )
        table[key] = Limit(
            key,
            **{
                name: _whole(entry[name], f"{key!r} {name}") for name in LIMIT_KEYS if name in entry
            },
        )
    return table


@functools.cache
def limit_table(raw: str | None) -> LimitTable:
    """:func:`parse_limits`, once per value (a file is read once per process)."""
    return parse_limits(raw)


def limit_for(model: str, table: LimitTable) -> Limit | None:
    """The exact entry, else the longest key ending at a separator that prefixes ``model``."""
    # a framework agent's spec (``openai:gpt-4.1#agent=...``) is limited as its model
    model = model.partition("#")[0]
    exact = table.get(model)
    if exact is not None:
        return exact
    prefixes = [k for k in table if k[-1] in SEPARATORS and model.startswith(k)]
    return table[max(prefixes, key=len)] if prefixes else None


def look_again_after(lease_seconds: float) -> timedelta:
    """When a call waiting for a held slot looks again by itself (a release wakes it sooner):
    a slot whose holder died lapses within a lease, so a lease is the longest it waits."""
    return timedelta(seconds=max(0.5, lease_seconds))


def stale_after(lease_seconds: float, stall_seconds: float) -> timedelta:
    """A waiter that stopped asking this long ago holds no one back (its run was stopped, or
    its wake-up is late): a few of its own waits, and a stalled sweep's."""
    return look_again_after(lease_seconds) * 3 + timedelta(seconds=2 * stall_seconds)


def estimate_tokens(characters: int) -> int:
    """A request's tokens before it is sent, from its size (corrected after by its usage)."""
    return max(1, characters // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Counted:
    """What the store counted for a limit, in the transaction that holds it."""

    now: datetime
    in_flight: int
    #: requests and tokens that count (taken or ended in the last WINDOW), and the earliest
    #: time one of them ended, or was taken if it has not: when it stops counting, less WINDOW
    recent: int
    recent_tokens: int
    oldest: datetime | None
    #: callers waiting ahead of this one (higher priority, or the same and earlier)
    ahead: int
    waiting: int
    paused_until: datetime | None
    #: callers woken lately (a release, or a caller that found room free) whose ticks are on
    #: their way: the room they were woken for is promised to them, not free to wake others
    woken: int = 0


@dataclass(frozen=True)
class Verdict:
    """Go (``wake_at`` None), or wait until ``wake_at``, and why."""

    wake_at: datetime | None
    reason: str = ""
    #: free room the callers ahead of this one are asleep on: wake this many of them, so the
    #: room is used while this caller keeps its place behind them
    wake_ahead: int = 0


def decide(limit: Limit, counted: Counted, tokens: int, fallback: timedelta) -> Verdict:
    """Whether a call of ``tokens`` may be sent now. It waits while the provider asked the
    fleet to pause, while a limit is full, or while others wait ahead of it for the room there
    is (fairness: a newcomer does not pass a waiting caller). ``fallback``: when to look again
    for a slot someone holds (a release normally wakes the next caller sooner)."""
    now = counted.now
    if counted.paused_until is not None and counted.paused_until > now:
        return Verdict(counted.paused_until, "the provider asked to wait")
    window_end = (counted.oldest + WINDOW) if counted.oldest is not None else now + fallback
    room = [
        n - used
        for n, used in ((limit.concurrency, counted.in_flight), (limit.rpm, counted.recent))
        if n is not None
    ]
    # Room already promised to callers woken lately is not woken for again: waking more
    # callers than there is room only sends ticks that find the line unchanged and wait again
    # (each a transaction and a message), crowding out the ones woken to go.
    wake_ahead = max(0, min(min(room, default=0), counted.ahead) - counted.woken)
    if limit.concurrency is not None:
        free = limit.concurrency - counted.in_flight
        if free <= counted.ahead:
            # A release wakes the next in line; by itself a caller looks again after a lease
            # (a dead holder's slot has lapsed by then), later the further back it is, so a
            # long line does not all wake at once to find its place unchanged.
            rounds = min(MAX_ROUNDS, 1 + counted.ahead // limit.concurrency)
            reason = f"{counted.in_flight} in flight"
            return Verdict(now + fallback * rounds, reason, wake_ahead)
    if limit.rpm is not None:
        free = limit.rpm - counted.recent
        if free <= counted.ahead:
            wake = max(window_end, now + timedelta(milliseconds=50))
            return Verdict(wake, "requests/min", wake_ahead)
    if limit.tpm is not None:
        soon = now + timedelta(milliseconds=50)
        over = counted.recent_tokens > 0 and counted.recent_tokens + tokens > limit.tpm
        if over:
            return Verdict(max(window_end, soon), "tokens/min", wake_ahead)
        if counted.ahead:
            # The tokens free are the callers' ahead first, whatever their sizes (unknown
            # here): a small newcomer that fits does not pass a larger call waiting for the
            # minute, or a stream of small calls starves it (I30). It looks again when the
            # window moves, or after a lease or more the further back it is (a release wakes
            # the next in line sooner).
            rounds = min(MAX_ROUNDS, 1 + counted.ahead)
            wake = max(soon, min(window_end, now + fallback * rounds))
            return Verdict(wake, "tokens/min", wake_ahead)
    return Verdict(None)
