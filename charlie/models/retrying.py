"""A run retrying its model call, as its state keeps it and people are shown it (I36).

call_model stores a :class:`Retrying` in the run's state while a model call that failed in a way
waiting may fix (a connection refused, a timeout, a 429 or 5xx) waits for its next attempt; the
next answer, or the failure at the bound, takes it away. Status, list, watch, the console and
``charlie doctor`` read it from there: the last error, how many attempts failed, when the next
one is due and when the retrying stops (``CHARLIE_MODEL_RETRY_SECONDS`` after the first
failure). Pure: no database, no clock but the one handed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

#: the run state's key (charlie/executor/phases/call_model.py writes it)
STATE_KEY = "model_retry"

#: the setting that bounds the retrying, named in the failure it ends in
SETTING = "CHARLIE_MODEL_RETRY_SECONDS"


@dataclass(frozen=True)
class Retrying:
    """A model call being retried: the last error, the failed attempts so far (each client
    attempt counts, not only the executor's), the first failure's time, the next attempt's
    time, and the bound in seconds from the first failure."""

    error: str
    attempts: int
    since: datetime
    next_at: datetime
    bound: float

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
        }

    def describe(self, now: datetime | None = None) -> str:
        """One line for a person: "retrying the model call: 3 attempts failed; next attempt
        at 21:40:05 UTC (in 4 s), gives up at 21:50:01 UTC; last error: ..."."""
        nxt = _clock(self.next_at)
        if now is not None:
            left = (self.next_at - now).total_seconds()
            nxt += f" (in {left:.0f} s)" if left >= 0.5 else " (due now)"
        plural = "attempt" if self.attempts == 1 else "attempts"
        return (
            f"retrying the model call: {self.attempts} {plural} failed; next attempt at {nxt}, "
            f"gives up at {_clock(self.until)}; last error: {self.error}"
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
