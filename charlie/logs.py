"""Log lines that say which run they are about.

Charlie's log calls pass their context as ``extra`` (task id, execution id, phase, version,
call id, ...). Celery's worker formats records with a fixed format string that prints none of
it, so the worker's handlers get a formatter that adds the context after the message, whatever
format the operator configured: ``key=value`` pairs by default, or one JSON object per line with
``CHARLIE_LOG_FORMAT=json`` for a log shipper. Either way no control character of a model's or
a tool's text reaches the log raw: text lines show them (charlie.terminal), JSON escapes them.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

from charlie.terminal import printable

#: the context keys that lead, in this order; any others follow sorted.
LEADING_KEYS = ("task_id", "execution_id", "phase", "version", "call_id", "to", "note", "trace_id")

#: attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}

#: a context value longer than this is cut in text lines (JSON lines keep it whole).
MAX_VALUE_CHARS = 300


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra`` fields of one of Charlie's records that have a value, leading keys first;
    for others (Celery's own records carry extras that its format already prints) only the
    trace id. With tracing on, a line logged inside a tick or a tool call says its trace."""
    trace_id = current_trace_id()
    if not record.name.startswith("charlie"):
        return {"trace_id": trace_id} if trace_id else {}
    attrs = vars(record)
    # (a set difference in C first: a record has some 25 standard attributes, few extras)
    fields = {
        k: attrs[k]
        for k in attrs.keys() - _STANDARD
        if not k.startswith("_") and attrs[k] is not None
    }
    leading = {k: fields.pop(k) for k in LEADING_KEYS if k in fields}
    if trace_id:
        fields.setdefault("trace_id", trace_id)
    return {**leading, **dict(sorted(fields.items()))}


def current_trace_id() -> str | None:
    """The current OpenTelemetry trace id (hex), if this process traces and a span is
    current; without OpenTelemetry imported, nothing is imported and nothing is looked up."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def _json(value: Any) -> str:
    """Never raises: a log line must not be lost (or break the tick that logs it) because of an
    odd value (mixed or tuple keys, a cycle, NaN); such a value is written as its repr."""
    try:
        return json.dumps(value, default=str, allow_nan=False)
    except Exception:
        pass
    try:
        return json.dumps(repr(value))
    except Exception:  # a repr can fail too (nested too deep, a broken __repr__)
        return json.dumps(f"<unprintable {type(value).__name__}>")


#: a character that makes a text value quoted: any but printable, non-space ASCII, and a quote
#: or an equals sign (a look-alike of one, a fullwidth equals sign U+FF1D or a Hangul filler
#: U+3164 that shows as a space, would make an unquoted value read as two pairs); one
#: character class, as cheap to scan as the whitespace class it replaces
_QUOTED = re.compile(r"[^\x21\x23-\x3c\x3e-\x7e]")


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else _json(value)
    if len(text) > MAX_VALUE_CHARS:
        text = text[:MAX_VALUE_CHARS] + "..."
    if not text or _QUOTED.search(text):
        text = json.dumps(text)  # (ASCII: every control and non-ASCII character escaped)
    return printable(text)


class ContextFormatter(logging.Formatter):
    """Wraps a handler's formatter: the line it would print, with the record's context appended
    to the message (so before any traceback)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        # A message, a context value or a traceback can quote a model's or a tool's text:
        # whoever tails the log sees its control characters, their terminal obeys none
        # (charlie.terminal; a traceback keeps its lines).
        context = context_of(record)
        if not context:
            return printable(self.inner.format(record), multiline=True)
        saved = record.msg, record.args
        pairs = " ".join(f"{k}={_text(v)}" for k, v in context.items())
        record.msg, record.args = f"{record.getMessage()} [{pairs}]", None
        try:
            return printable(self.inner.format(record), multiline=True)
        finally:
            record.msg, record.args = saved


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, process, message, context, traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": record.processName,
            "message": record.getMessage(),
        }
        for key, value in context_of(record).items():
            entry.setdefault(key, json.loads(_json(value)))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a traceback a filter already formatted (charlie.mcp scrubs them)
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)


def install(logger: logging.Logger, *, json_lines: bool = False) -> None:
    """Give each of the logger's handlers the context (idempotent)."""
    for handler in logger.handlers:
        current = handler.formatter
        if json_lines:
            if not isinstance(current, JsonFormatter):
                handler.setFormatter(JsonFormatter())
        elif not isinstance(current, ContextFormatter):
            handler.setFormatter(ContextFormatter(current))
