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
import os
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
from charlie.models.retrying import attempts_failed

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
_log = logging.getLogger(__name__)


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


#: the longest wait a provider's answer may impose, in seconds, unless
#: CHARLIE_MODEL_RETRY_AFTER_MAX says otherwise: a larger one is capped (and said).
DEFAULT_RETRY_AFTER_MAX = 600.0
#: the rate-limit reset headers a wait is read from when no ``Retry-After`` is given, each with
#: the remaining-count header that says whether it is the limit that ran out
RESET_HEADERS = (
    ("x-ratelimit-reset-requests", "x-ratelimit-remaining-requests"),
    ("x-ratelimit-reset-tokens", "x-ratelimit-remaining-tokens"),
    ("anthropic-ratelimit-requests-reset", "anthropic-ratelimit-requests-remaining"),
    ("anthropic-ratelimit-tokens-reset", "anthropic-ratelimit-tokens-remaining"),
    ("anthropic-ratelimit-input-tokens-reset", "anthropic-ratelimit-input-tokens-remaining"),
    ("anthropic-ratelimit-output-tokens-reset", "anthropic-ratelimit-output-tokens-remaining"),
    ("ratelimit-reset", "ratelimit-remaining"),
    ("x-ratelimit-reset", "x-ratelimit-remaining"),
)
#: a reset given as a number this large is a Unix time, not seconds from now
_EPOCH_SECONDS = 1e9
#: OpenAI's durations: ``1s``, ``6m0s``, ``1h2m3.5s``, ``20ms``
_NUM = r"(\d+(?:\.\d+)?)"
_DURATION = re.compile(rf"(?:{_NUM}h)?(?:{_NUM}m(?!s))?(?:{_NUM}s)?(?:{_NUM}ms)?")
#: the most characters of a provider's value a warning quotes
_QUOTED = 80


@dataclass(frozen=True)
class ProviderWait:
    """How long a provider's answer asks to wait: ``seconds`` (never more than the cap),
    ``header`` and ``value`` (what it said, as it said it), and whether the cap cut it."""

    seconds: float
    header: str
    value: str
    capped: bool = False


def provider_wait(
    headers: Mapping[str, str], now: datetime | None = None, cap: float = DEFAULT_RETRY_AFTER_MAX
) -> ProviderWait | None:
    """The wait a provider's answer asks for, or None when it names none (or none this reads).

    ``retry-after-ms``, then ``Retry-After`` (seconds or an HTTP date), then the rate-limit reset
    headers (of the limits the answer says ran out, remaining 0; the longest). Pure and
    total: any text, however large, malformed or far in the future, gives a finite wait in
    ``[0, cap]`` or None, never an exception (a value too large to hold is the cap)."""
    now = now or datetime.now(UTC)
    cap = cap if math.isfinite(cap) and cap > 0 else DEFAULT_RETRY_AFTER_MAX
    found: tuple[float, str, str] | None = None
    for header, read in (("retry-after-ms", _millis), ("retry-after", _seconds_or_date)):
        raw = _header(headers, header)
        if raw is not None:
            seconds = read(raw, now)
            if seconds is not None:
                found = (seconds, header, raw)
                break
    if found is None:
        for header, remaining in RESET_HEADERS:
            raw = _header(headers, header)
            # only a limit the answer says ran out: a reset header alone comes with every
            # answer (a 5xx too), and names when a window ends, not that it must be waited for
            if raw is None or _number(_header(headers, remaining) or "") != 0:
                continue
            seconds = _reset(raw, now)
            if seconds is not None and (found is None or seconds > found[0]):
                found = (seconds, header, raw)
    if found is None:
        return None
    seconds, header, raw = found
    # the provider's text, quoted in a log line: one printable line, cut short
    shown = "".join(c if c.isprintable() else "?" for c in raw)
    value = shown if len(shown) <= _QUOTED else shown[: _QUOTED - 1] + "…"
    if not seconds <= cap:  # inf and nan included
        return ProviderWait(cap, header, value, capped=True)
    return ProviderWait(max(0.0, seconds), header, value)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    try:
        raw = headers.get(name)
    except Exception:  # a mapping that refuses a name holds nothing this reads
        return None
    if raw is None:
        return None
    text = str(raw).strip()
    return text or None


def _number(raw: str) -> float | None:
    """A decimal number (``inf`` for one too large to hold), or None for anything else."""
    if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", raw):
        return None
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        return None
    return value if not math.isnan(value) else None


def _millis(raw: str, now: datetime) -> float | None:
    value = _number(raw)
    return None if value is None else value / 1000


def _seconds_or_date(raw: str, now: datetime) -> float | None:
    value = _number(raw)
    if value is not None:
        return value
    return _until(raw, now)


def _until(raw: str, now: datetime) -> float | None:
    """Seconds from ``now`` to an HTTP date or an RFC 3339 time (None: neither)."""
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError, OverflowError):
        try:
            when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except (ValueError, OverflowError):
            return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        return (when - now).total_seconds()
    except OverflowError:
        return math.inf


def _reset(raw: str, now: datetime) -> float | None:
    """A reset header: seconds (or a Unix time), a duration (``6m0s``), or a time."""
    value = _number(raw)
    if value is not None:
        return value - now.timestamp() if value >= _EPOCH_SECONDS else value
    match = _DURATION.fullmatch(raw)
    if match and any(match.groups()):
        h, m, s, ms = (float(g) if g else 0.0 for g in match.groups())
        return h * 3600 + m * 60 + s + ms / 1000
    return _until(raw, now)


def retry_after_max(env: Mapping[str, str] | None = None) -> float:
    """CHARLIE_MODEL_RETRY_AFTER_MAX (seconds): the longest wait a provider may impose. A value
    that is not a positive number is the default here (the settings refuse it at start)."""
    raw = (os.environ if env is None else env).get("CHARLIE_MODEL_RETRY_AFTER_MAX", "").strip()
    value = _number(raw) if raw else None
    return value if value is not None and 0 < value < math.inf else DEFAULT_RETRY_AFTER_MAX


def parse_retry_after(
    headers: Mapping[str, str], now: datetime | None = None, *, spec: str | None = None
) -> float | None:
    """Seconds to wait from a provider's answer (see provider_wait), capped by
    CHARLIE_MODEL_RETRY_AFTER_MAX; a capped wait is logged with the provider's own value."""
    wait = provider_wait(headers, now, retry_after_max())
    if wait is None:
        return None
    if wait.capped:
        _log.warning(
            "the provider asked to wait %s (%s); waiting %.0f s, CHARLIE_MODEL_RETRY_AFTER_MAX",
            wait.value,
            wait.header,
            wait.seconds,
            extra={
                "provider_header": wait.header,
                "provider_value": wait.value,
                "wait": wait.seconds,
                **({"model": spec} if spec else {}),
            },
        )
    return wait.seconds


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
                    "model call: %s in this try; the run retries it later: %s",
                    attempts_failed(attempt),
                    failure.message,
                    extra=more,
                )
                # the count is the evidence's (and the run's state counts every attempt
                # of the call, I36): the message is the provider's, shown beside that count
                raise TransientModelError(
                    f"{spec}: {failure.message}",
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
