"""Log records without the console's credentials.

The token travels in a page's first address (``?token=``) and in ``Authorization: Bearer``;
the session cookie is as good as the token for a week. Tornado writes a request's whole URI
in its access log (every 4xx is a warning), in an HTTPError's warning and with an uncaught
exception, and a malformed request's header in an info line. So:

- the console's handlers log a request as its method, its path and its query with every
  ``token`` parameter's value (whatever its spelling, ``%74oken`` included) and every value
  equal to the token replaced by ``[redacted]`` (:func:`request_summary`), never the request's
  repr;
- and a filter on Tornado's, asyncio's and Charlie's loggers and on the process's log handlers
  (:class:`Scrubber`) blanks, in every record's message and traceback, the token as it is and
  as a URL carries it, any ``token=`` query value, any ``Bearer`` credential and the session
  cookie's value: what the handlers' own lines cannot cover (a line from Tornado's HTTP
  parser, a third party's record) is caught there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus, unquote_plus

from tornado.httputil import HTTPServerRequest

from charlie.console.auth import SESSION_COOKIE

REDACTED = "[redacted]"
#: the query parameter a page's first address carries the token in
TOKEN_PARAM = "token"
#: one ``key=value`` of a query string, after its ``?``, ``&`` or ``;``
_QUERY_PAIR = re.compile(r"(?P<lead>[?&;])(?P<key>[^=&;#\s'\"?]*)=(?P<value>[^&;#\s'\"]*)")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\",;]+")
_COOKIE = re.compile(rf"\b({re.escape(SESSION_COOKIE)}=)[^;\s'\",]+")
#: the loggers whose records can carry a request's address or headers
GUARDED = ("tornado", "tornado.access", "tornado.application", "tornado.general", "asyncio")


def _secret_key(key: str) -> bool:
    return unquote_plus(key).strip().lower() == TOKEN_PARAM


class Scrubber(logging.Filter):
    """Blanks the console's credentials out of log records, message and traceback both."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        forms = {form for s in secrets if s for form in (s, quote(s, safe=""), quote_plus(s))}
        # the longest first, so a form inside another is not left half-blanked
        self.secrets = sorted(forms, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)

        def pair(m: re.Match[str]) -> str:
            if _secret_key(m["key"]):
                return f"{m['lead']}{m['key']}={REDACTED}"
            return m[0]

        text = _QUERY_PAIR.sub(pair, text)
        text = _BEARER.sub(rf"\g<1>{REDACTED}", text)
        return _COOKIE.sub(rf"\g<1>{REDACTED}", text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: shown as its format
            message = str(record.msg)
        scrubbed = self.scrub(message)
        if scrubbed != message or record.args:
            record.msg, record.args = scrubbed, None
        if record.exc_info:
            # formatted here, scrubbed, and the exception dropped, so no formatter shows it raw
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text, record.exc_info = self.scrub(text), None
        elif record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)
        return True


def install(scrubber: Scrubber, root: logging.Logger | None = None) -> None:
    """Put the filter on the guarded loggers and on every handler of ``root`` (idempotent).

    A logger's filter sees only what is logged to that logger, a handler's everything it
    writes: the handlers catch what propagates from anywhere, the loggers' own filters keep
    Tornado's records clean for a handler added later."""
    root = root or logging.getLogger()
    for name in (*GUARDED, "charlie"):
        logger = logging.getLogger(name)
        if scrubber not in logger.filters:
            logger.addFilter(scrubber)
    for handler in root.handlers:
        if scrubber not in handler.filters:
            handler.addFilter(scrubber)


def redacted_uri(request: HTTPServerRequest, token: str) -> str:
    """The request's path and query, with the token's parameter and any value equal to the
    token replaced (see the module's docstring)."""
    if not request.query:
        return request.path
    pairs = []
    for piece in re.split(r"[&;]", request.query):
        key, sep, value = piece.partition("=")
        if sep and (_secret_key(key) or (token and unquote_plus(value) == token)):
            value = REDACTED
        pairs.append(f"{key}{sep}{value}")
    return f"{request.path}?{'&'.join(pairs)}"


def request_summary(request: HTTPServerRequest, token: str) -> str:
    """What Tornado's log lines say of a request (method, address, client), redacted."""
    return f"{request.method} {redacted_uri(request, token)} ({request.remote_ip})"
