"""The retry policy every HTTP model client shares, and the helpers its configuration uses.

A call is tried up to ``max_attempts`` times. A retryable failure waits the server's
``Retry-After`` (``retry-after-ms``, seconds or an HTTP date) or an exponential backoff with full
jitter; a wait is slept inside the call only while it is short (``max_sleep``): a longer one, or
running out of attempts, raises :class:`TransientModelError` with ``retry_after`` so the executor
stores a wake-up time instead of sleeping in a tick. A failure that waiting will not fix raises
:class:`ModelError` with its evidence. Provider clients only say what one attempt gave
(:class:`Failure` or a value) and keep their own SDK's retries off.
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit

from charlie.domain import JSON
from charlie.models.base import Deltas, ModelError, TransientModelError

DEFAULT_READ_TIMEOUT = 120.0
CONNECT_TIMEOUT = 10.0
DEFAULT_MAX_ATTEMPTS = 5
#: the longest backoff slept inside ``complete``; a longer one is handed to the executor.
DEFAULT_MAX_SLEEP = 5.0
DEFAULT_BACKOFF_BASE = 0.5
DEFAULT_BACKOFF_CAP = 60.0
EVIDENCE_BODY_BYTES = 4096
REDACTED = "[REDACTED]"
#: a provider refusing for load: too many requests, and Anthropic's overloaded
THROTTLE_STATUSES = frozenset({429, 529})

T = TypeVar("T")


def env_name(model: str) -> str:
    """The ``<NAME>`` in ``CHARLIE_MODEL_<NAME>_BASE_URL`` for a model name."""
    return re.sub(r"[^A-Za-z0-9]", "_", model).upper()


def origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port: what a credential is bound to."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def env_number(name: str, env: Mapping[str, str], default: float) -> float:
    """A positive number from the environment, or ``default`` when unset."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ModelError(f"{name}={raw!r} is not a positive number")
    return value


def env_whole(name: str, env: Mapping[str, str], default: int) -> int:
    """A positive whole number from the environment, or ``default`` when unset."""
    value = env_number(name, env, default)
    if value != int(value):
        raise ModelError(f"{name}={value!r} is not a whole number")
    return int(value)


def check_key(api_key: str | None, model: str) -> str | None:
    """A key a header can carry, or None; the error never quotes the key."""
    if api_key is not None and not re.fullmatch(r"[\x21-\x7e]+", api_key):
        raise ModelError(f"the API key for {model!r} has characters a header cannot carry")
    return api_key


def parse_retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            value = float(millis) / 1000
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return max(0.0, value)
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        return max(0.0, value) if math.isfinite(value) else None
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class Redactor:
    """Takes a key out of text before it reaches a message, evidence or a log line."""

    def __init__(self, secret: str | None) -> None:
        self._secret = secret

    def __call__(self, text: str) -> str:
        return text.replace(self._secret, REDACTED) if self._secret else text

    def truncate(self, text: str) -> str:
        """Redacted, then cut to the first 4 KiB (a body kept as evidence)."""
        data = self(text).encode("utf-8", "replace")
        return data[:EVIDENCE_BODY_BYTES].decode("utf-8", "ignore")


@dataclass
class Failure:
    """What one failed attempt said: a message, evidence (never request headers), and whether
    waiting may fix it."""

    message: str
    evidence: JSON
    status: int | None = None
    retry_after: float | None = None
    retryable: bool = True
    #: the failure came after part of a stream was read (its deltas were sent)
    streamed: bool = False


@dataclass
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    max_sleep: float = DEFAULT_MAX_SLEEP
    backoff_base: float = DEFAULT_BACKOFF_BASE
    backoff_cap: float = DEFAULT_BACKOFF_CAP
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random | None = None

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = random.Random()

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^(attempt-1)))."""
        ceiling = min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1))
        assert self.rng is not None
        return self.rng.uniform(0, ceiling)

    def run(
        self,
        attempt_once: Callable[[], T | Failure],
        *,
        spec: str,
        log: logging.Logger,
        extra: dict[str, Any],
        deltas: Deltas | None = None,
        throttled: Callable[[float], None] | None = None,
    ) -> T:
        """``attempt_once`` until it gives a value, within the policy (see the module). A
        streamed attempt that failed is announced to ``deltas`` before the next one, so a
        watcher drops what it showed of it. A provider's refusal for load (429, Anthropic's
        529) is told to ``throttled`` with the wait before anything else: the fleet's callers
        of its limit wait that long too, not only this call."""
        attempts = self.max_attempts
        for attempt in range(1, attempts + 1):
            outcome = attempt_once()
            if not isinstance(outcome, Failure):
                return outcome
            failure = outcome
            more = {**extra, "attempt": attempt, "status": failure.status}
            if not failure.retryable:
                log.warning("model call refused: %s", failure.message, extra=more)
                raise ModelError(f"{spec}: {failure.message}", evidence=failure.evidence)
            evidence = {**failure.evidence, "attempts": attempt}
            if throttled is not None and failure.status in THROTTLE_STATUSES:
                throttled(failure.retry_after if failure.retry_after is not None else 1.0)
            if attempt >= attempts:
                log.warning(
                    "model call failed %d times; the run retries it later: %s",
                    attempt,
                    failure.message,
                    extra=more,
                )
                raise TransientModelError(
                    f"{spec}: {failure.message} ({attempt} attempts failed)",
                    retry_after=failure.retry_after,
                    evidence=evidence,
                )
            wait = failure.retry_after
            if wait is None:
                wait = self.backoff(attempt)
            if wait > self.max_sleep:
                log.warning(
                    "model call failed; retry in %.1f s is left to the executor: %s",
                    wait,
                    failure.message,
                    extra={**more, "wait": wait},
                )
                raise TransientModelError(
                    f"{spec}: {failure.message} (retry in {wait:.1f} s)",
                    retry_after=wait,
                    evidence=evidence,
                )
            if failure.streamed and deltas is not None:
                deltas.restart(failure.message)
            log.warning(
                "model call failed; retrying in %.2f s: %s",
                wait,
                failure.message,
                extra={**more, "wait": wait},
            )
            self.sleep(wait)
        raise AssertionError("unreachable: max_attempts is at least 1")
