"""How a tool's handler (or its reconcile hook) is called, and what its result becomes.

Pure of the engine: no database, no broker. The executor's invocation calls these between the
claim and the settle; :mod:`charlie.testing` calls the same ones, so a tool tested without a
cluster meets exactly the calling convention (and the failure mapping, I15) it meets on a worker.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from charlie.domain import JSON, Outcome
from charlie.tools.context import Interrupted, Reconciled, ToolContext, ToolError
from charlie.tools.registry import ToolDef


class LookFailed(Exception):
    """An overdue wait's look raised something other than a ToolError: no answer about the
    outside work (a database or network hiccup), so the late watch looks again later."""


def _ctx_kw(definition: ToolDef, ctx: ToolContext) -> dict[str, Any]:
    return {definition.context_param: ctx} if definition.context_param else {}


def run_handler(definition: ToolDef, arguments: JSON, ctx: ToolContext) -> tuple[Outcome, Any]:
    """Call the handler: its return value is an ``ok`` result (or a ``Pending``), a ToolError
    or any other exception an ``error`` result the model sees (I15). On an overdue look a
    non-ToolError exception is no answer at all: LookFailed."""
    if ctx.refusal is not None:
        return Outcome.ERROR, {"error": ctx.refusal}
    try:
        return Outcome.OK, definition.handler(**{**arguments, **_ctx_kw(definition, ctx)})
    except Interrupted as exc:
        return Outcome.INTERRUPTED, exc.as_result()
    except ToolError as exc:
        return Outcome.ERROR, exc.as_result()
    except Exception as exc:
        if ctx.overdue:
            raise LookFailed(f"{type(exc).__name__}: {exc}") from exc
        # I15: a tool that raises is a result the model sees, not a failed run.
        return Outcome.ERROR, {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))[-4000:],
        }


def run_reconcile(
    definition: ToolDef, arguments: JSON, ctx: ToolContext, evidence: JSON
) -> tuple[Outcome, Any]:
    """Call the reconcile hook of a call found started without a result (I10): its
    ``Reconciled`` finding is the outcome; anything else (``None``, an exception) leaves the
    call ``interrupted``, with the evidence either way."""
    assert definition.reconcile is not None
    evidence = dict(evidence)
    if ctx.refusal is not None:
        # Cannot look: the call stays what the evidence says, unknown.
        return Outcome.INTERRUPTED, {**evidence, "reconciled": False, "error": ctx.refusal}
    try:
        found = definition.reconcile(**{**arguments, **_ctx_kw(definition, ctx)})
    except Exception as exc:
        found = None
        evidence["reconcile_error"] = f"{type(exc).__name__}: {exc}"
    if isinstance(found, Reconciled):
        result = found.result if isinstance(found.result, dict) else {"result": found.result}
        return found.outcome, {**result, "reconciled": True, "evidence": evidence}
    return Outcome.INTERRUPTED, {**evidence, "reconciled": False}


def storable(value: Any) -> Any:
    """``value`` with what no database can store made visible instead: a NUL character
    (PostgreSQL's text and jsonb refuse it, and the call could not settle) becomes U+FFFD, and
    a lone surrogate (no UTF-8 for it) ``?``. Binary output is data like any other (I15)."""
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode()
        except UnicodeEncodeError:
            value = value.encode(errors="replace").decode()
        return value
    if isinstance(value, dict):
        return {storable(str(k)): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def cap_result(result: Any, limit: int) -> Any:
    """Oversized results are cut, and say so, rather than refused: the call still settles.
    What no database can store (a NUL) is made visible first (``storable``)."""
    text = json.dumps(storable(result), default=str, ensure_ascii=False)
    if len(text.encode()) <= limit:
        return json.loads(text)
    return {
        "truncated": True,
        "original_bytes": len(text.encode()),
        "head": text.encode()[: limit // 2].decode(errors="ignore"),
    }
