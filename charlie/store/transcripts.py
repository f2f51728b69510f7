"""Each run's committed transcript as this process last saw it.

A call_model tick needs the whole transcript, and reading it again every turn costs a round
trip and a decode of every item so far. Transcript items are only ever appended, under the
run's compare-and-set, and never changed, so a prefix this process saw committed stays true:
a tick reads only the items after it (none when the claim's ``next_seq`` says there are none
besides the ones its own transaction wrote).

The cache holds only what has committed: a worker puts a transcript into it after the COMMIT
of the transaction that read or wrote its last items, never before (a rolled-back write must
not be remembered). Items this worker wrote are remembered as the database returns them
(:func:`as_stored`), or not at all.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from charlie.domain import Item, ItemKind

#: runs remembered per process; a worker runs a few at once, so this is plenty (a long run's
#: transcript can be megabytes, and a finished run is forgotten at once)
RUNS = 32


class TranscriptCache:
    """A committed prefix of each recent run's transcript, least recently used dropped. Safe
    to share between the threads of a ``threads`` pool. Its items are shared with whoever
    reads them (a model adapter among them): read-only, as every phase treats them."""

    def __init__(self, size: int = RUNS) -> None:
        self._size = size
        #: execution id -> (the run's identity, its items, the index of the newest compaction
        #: item among them or -1): found as items are put, so a model call's input planning
        #: does not walk the whole transcript for it at every turn
        self._runs: OrderedDict[str, tuple[object, tuple[Item, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, execution_id: str, identity: object) -> tuple[Item, ...]:
        """The remembered prefix of the run ``identity`` names (runs.Claim.identity: the
        database and the run's incarnation): nothing when what is remembered under its id is
        another run's (a recreated database, a restored backup, a task id used again), which
        is forgotten."""
        return self.remembered(execution_id, identity)[0]

    def remembered(self, execution_id: str, identity: object) -> tuple[tuple[Item, ...], int]:
        """The remembered prefix (as :meth:`get`) and the index of its newest ``compaction``
        item (-1: none)."""
        with self._lock:
            entry = self._runs.get(execution_id)
            if entry is None:
                return (), -1
            if entry[0] != identity or identity is None:
                del self._runs[execution_id]
                return (), -1
            self._runs.move_to_end(execution_id)
            return entry[1], entry[2]

    def forget(self, execution_id: str) -> None:
        """The run finished: nothing will read its transcript here again."""
        with self._lock:
            self._runs.pop(execution_id, None)

    def put(self, execution_id: str, identity: object, items: Sequence[Item]) -> None:
        """Remember ``items`` (seq 0, 1, ...: a whole committed prefix) of the run ``identity``
        names if they are longer than what is remembered of it; anything else is a caller's
        mistake, and forgets the run."""
        with self._lock:
            known = self._runs.get(execution_id)
            # Items numbered 0, 1, ...: checked only past the remembered prefix when they
            # extend it with its very objects (checked when it was put; a tuple comparison
            # tries identity first, in C), so a long run's put does not walk it all in Python.
            checked, newest = 0, -1
            if known is not None and known[0] == identity and 0 < len(known[1]) <= len(items):
                prefix = known[1]
                if items[len(prefix) - 1] is prefix[-1] and tuple(items[: len(prefix)]) == prefix:
                    checked, newest = len(prefix), known[2]
            if identity is None:
                self._runs.pop(execution_id, None)
                return
            for n in range(checked, len(items)):
                item = items[n]
                if item.seq != n:
                    self._runs.pop(execution_id, None)
                    return
                if item.kind is ItemKind.COMPACTION:
                    newest = n
            if known is None or known[0] != identity or len(items) >= len(known[1]):
                self._runs[execution_id] = (identity, tuple(items), newest)
                self._runs.move_to_end(execution_id)
            while len(self._runs) > self._size:
                self._runs.popitem(last=False)


def as_stored(payload: Any, dialect: str) -> tuple[bool, Any]:
    """``payload`` as the database returns it after storing it as JSON: (True, it), or
    (False, None) when that cannot be known without reading it back.

    SQLite keeps the JSON text as written; PostgreSQL's jsonb orders each object's keys (the
    shorter first, then bytewise) and keeps a number as its decimal digits: a float written
    without an exponent comes back as itself, one with an exponent in a form of its own
    (``1e16`` as the integer 10000000000000000, ``1e-07`` as ``0.0000001``), and ``-0.0`` as
    ``0.0``, so those are not predicted. Tuples come back as lists on both."""
    if isinstance(payload, bool) or payload is None or isinstance(payload, str | int):
        return True, payload
    if isinstance(payload, float):
        if dialect == "sqlite":
            return True, payload
        negative_zero = payload == 0 and math.copysign(1.0, payload) < 0
        plain = math.isfinite(payload) and "e" not in repr(payload) and not negative_zero
        return (True, payload) if plain else (False, None)
    if isinstance(payload, list | tuple):
        out = []
        for value in payload:
            ok, stored = as_stored(value, dialect)
            if not ok:
                return False, None
            out.append(stored)
        return True, out
    if isinstance(payload, dict):
        pairs = []
        for key, value in payload.items():
            if not isinstance(key, str):
                return False, None  # json.dumps turns it into a string; not worth following
            ok, stored = as_stored(value, dialect)
            if not ok:
                return False, None
            pairs.append((key, stored))
        if dialect != "sqlite":
            pairs.sort(key=lambda kv: (len(kv[0].encode()), kv[0].encode()))
        return True, dict(pairs)
    return False, None
