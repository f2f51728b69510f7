"""A run retrying its model call, as its state keeps it and people are shown it (I36).

call_model stores a :class:`Retrying` in the run's state while a model call that failed in a way
waiting may fix (a connection refused, a timeout, a 429 or 5xx) waits for its next attempt; the
next answer, or the failure at the bound, takes it away. Status, list, watch, the console and
``charlie doctor`` read it from there: the last error, how many attempts failed, when the next
one is due and when the retrying stops (``CHARLIE_MODEL_RETRY_SECONDS`` after the first
failure), and the console's timeline its latest waits. One count of attempts everywhere: the
state's, which every view says in the same words (:func:`attempts_failed`); the error is the
provider's, with no count of its own. Pure: no database, no clock but the one handed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

#: the run state's key (charlie/executor/phases/call_model.py writes it)
STATE_KEY = "model_retry"

#: the setting that bounds the retrying, named in the failure it ends in
SETTING = "CHARLIE_MODEL_RETRY_SECONDS"

#: how many of a retry's waits its state keeps for the timeline: the latest, so the state
#: stays small however long the retrying goes on
KEPT_WAITS = 8
#: how much of each kept wait's error the state holds (the latest error is kept whole)
WAIT_ERROR_CHARS = 300


def attempts_failed(attempts: int) -> str:
    """The count as every view says it: "1 attempt failed", "10 attempts failed"."""
    return f"{attempts} attempt failed" if attempts == 1 else f"{attempts} attempts failed"


@dataclass(frozen=True)
class Wait:
    """One failed try of the model call and the wait after it, as the timeline draws them on
    the lane of the worker that tried: when its tick began asking, when its last attempt
    failed, when the next attempt is due, the attempts failed by then (the run's count), the
    error, and the run's count of its own first attempt (0: not known, a state written before
    it was kept), so that the oldest wait kept says its own attempts once older ones are
    dropped (KEPT_WAITS)."""

    worker: str
    turn: int
    began: datetime
    failed_at: datetime
    next_at: datetime
    attempts: int
    error: str
    first: int = 0

    def as_state(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "turn": self.turn,
            "began": self.began.isoformat(),
            "failed_at": self.failed_at.isoformat(),
            "next_at": self.next_at.isoformat(),
            "attempts": self.attempts,
            "error": self.error[:WAIT_ERROR_CHARS],
            "first": self.first,
        }


@dataclass(frozen=True)
class Retrying:
    """A model call being retried: the last error, the failed attempts so far (each client
    attempt counts, not only the executor's), the first failure's time, the next attempt's
    time, the bound in seconds from the first failure, and the latest waits (oldest first)."""

    error: str
    attempts: int
    since: datetime
    next_at: datetime
    bound: float
    waits: tuple[Wait, ...] = ()

    @property
    def until(self) -> datetime:
        """When the retrying stops and the task fails with the last error."""
        return self.since + timedelta(seconds=self.bound)

    def as_state(self) -> dict[str, Any]:
        return {
            "error": self.error[:2000],
            "attempts": self.attempts,
            "since": self.since.isoformat(),
            "next_at": self.next_at.isoformat(),
            "bound": self.bound,
            "waits": [w.as_state() for w in self.waits[-KEPT_WAITS:]],
        }

    def describe(self, now: datetime | None = None) -> str:
        """One line for a person: "retrying the model call: 3 attempts failed; next attempt
        at 21:40:05 UTC (in 4 s), gives up at 21:50:01 UTC; last error: ..."."""
        nxt = _clock(self.next_at)
        if now is not None:
            left = (self.next_at - now).total_seconds()
            nxt += f" (in {left:.0f} s)" if left >= 0.5 else " (due now)"
        return (
            f"retrying the model call: {attempts_failed(self.attempts)}; next attempt at "
            f"{nxt}, gives up at {_clock(self.until)}; last error: {self.error}"
        )


def from_state(state: Any) -> Retrying | None:
    """The retry a run's state records, or None (none, or a shape this version cannot read)."""
    raw = state.get(STATE_KEY) if isinstance(state, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return Retrying(
            error=str(raw.get("error", "")),
            attempts=int(raw["attempts"]),
            since=_parse(raw["since"]),
            next_at=_parse(raw["next_at"]),
            bound=float(raw["bound"]),
            waits=tuple(w for w in map(_wait, raw.get("waits") or ()) if w is not None),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _wait(raw: Any) -> Wait | None:
    if not isinstance(raw, dict):
        return None
    try:
        return Wait(
            worker=str(raw.get("worker") or ""),
            turn=int(raw.get("turn") or 0),
            began=_parse(raw["began"]),
            failed_at=_parse(raw["failed_at"]),
            next_at=_parse(raw["next_at"]),
            attempts=int(raw["attempts"]),
            error=str(raw.get("error", "")),
            first=int(raw.get("first") or 0),
        )
    except (KeyError, TypeError, ValueError):
        return None


def attempts_in(exc: BaseException) -> int:
    """How many attempts a client's failure counts (its evidence's ``attempts``; else 1)."""
    evidence = getattr(exc, "evidence", None)
    value = evidence.get("attempts") if isinstance(evidence, dict) else None
    return value if isinstance(value, int) and value > 0 else 1


def gave_up(model: str, attempts: int, elapsed: float, bound: float, error: str) -> str:
    """The failure at the bound: what failed, for how long, which setting bounds it."""
    plural = "attempt" if attempts == 1 else "attempts"
    return (
        f"model {model} kept failing: {attempts} {plural} over {elapsed:.0f} s, and the next "
        f"would pass the retry bound ({SETTING}={bound:g}); last error: {error}"
    )


def _parse(value: Any) -> datetime:
    when = datetime.fromisoformat(str(value))
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _clock(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%H:%M:%S UTC")
