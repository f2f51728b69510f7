"""The model calls this process has in flight: counted around each provider request, so a
worker's heartbeat can say how many agents it keeps moving (`charlie doctor`, the console).
One process's count: a prefork worker's children each count their own."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_now = 0
_peak = 0


@contextmanager
def counted() -> Iterator[None]:
    """Around one provider request: it is in flight until it returns or raises."""
    global _now, _peak
    with _lock:
        _now += 1
        _peak = max(_peak, _now)
    try:
        yield
    finally:
        with _lock:
            _now -= 1


def in_flight() -> int:
    """The calls in flight in this process now."""
    return _now


def peak(reset: bool = False) -> int:
    """The most in flight at once since the last reset (``reset``: start over from now's)."""
    global _peak
    with _lock:
        seen = _peak
        if reset:
            _peak = _now
        return seen
