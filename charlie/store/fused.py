"""Fused commits: the steps of a merged transaction written in one statement.

A merged transaction carries several phase transitions with nothing outside the database
between them (see executor/tick.py, "Merged transactions"). Each of its steps needs what the
step before it left, and on PostgreSQL the worker already knows that: it wrote it, or it
predicted it (runs.claimed_next, runs.calls_as_left). So the worker computes every step first
(each its own claim, boundary, phase and ``transitions`` row, I1, I21) and writes their net
effect here, in one statement run in autocommit: one round trip, where the same steps written
one by one take a BEGIN, a statement or two per step and a COMMIT.

The statement assumes the rows are what the worker predicted; it checks, once it holds them,
in the order every writer locks them (the run, then the turn's calls, then the task):

- the run's row is matched by its compare-and-set (phase, version, and the lease: this
  worker's for a claim it carried, else free to claim and as predicted: attempts, mailbox,
  turn, next_seq, state, no error). No match writes nothing, and returns nothing;
- the calls it settles are still open and held by this worker under the lease it took; the
  turn has the calls predicted;
- the task's status and timeout are those the boundaries were checked against, read under a
  share lock (or the task's own UPDATE): a cancel either waits for this commit or fails it.

A failed check raises ``charlie_expect``'s error (SQLSTATE CH001, migration 0009), which
rolls the whole statement back. Either way nothing was written, and the worker commits the
same steps the ordinary way, reading the rows as they are now. SQLite has no data-modifying
CTEs: there every step is written the ordinary way.

JSON values travel inside one JSON document per table (``jsonb_to_recordset``), each wrapped
as ``{"v": value}`` so that a ``None`` is stored as JSON ``null``, as SQLAlchemy's JSON type
stores it on the ordinary path.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from charlie import faults
from charlie.domain import JSON, Phase
from charlie.store.engine import PREPARED_OPTION, sqlstate
from charlie.store.runs import ACTIVE, TOKEN_COLUMNS, Fresh

log = logging.getLogger(__name__)

#: a fused statement's execution options: prepared on the server where the connection allows
#: it (engine._execute_prepared)
PREPARED_EXECUTION = {PREPARED_OPTION: True}

#: charlie_expect's SQLSTATE: a fused commit's assumption failed (nothing was written)
ASSUMPTION_FAILED = "CH001"


@dataclass(frozen=True)
class RunBefore:
    """The run's row as the fused steps assumed it.

    ``owner``: the first step's claim was committed by this worker (a carried call_model
    claim), so the row must still be leased to it. Without it the statement takes the first
    step's claim itself (attempts + 1, as the claim statement would), so the row must be free
    to claim and as predicted."""

    execution_id: str
    task_id: str
    phase: Phase
    version: int
    owner: str | None = None
    attempts: int = 0
    inbox: int = 0
    turn: int = 0
    next_seq: int = 0
    state: JSON | None = None


@dataclass(frozen=True)
class RunAfter:
    """The run's row once the last step moved it."""

    phase: Phase
    steps: int
    turns: int
    items: int
    #: None: the steps left the state as it was
    state: JSON | None
    model_calls: int
    model_repeats: int
    #: the last step also claims the next for the committing worker, leased until then
    #: (attempts 1); None: the lease is released (attempts 0)
    lease_until: datetime | None
    wake_at: datetime | None = None


@dataclass(frozen=True)
class Record:
    """One step's ``transitions`` row (I21)."""

    from_phase: Phase
    to_phase: Phase
    version: int
    at: datetime
    duration_ms: float
    note: str | None


@dataclass(frozen=True)
class Settle:
    """A call this commit settles (the turn's local call): only while it is open and held by
    the committing worker under the attempt (``token``) it started it with (I12)."""

    call_id: str
    outcome: str
    result: Any
    duration_ms: float | None
    finish_order: int | None
    token: int
    #: when the step that settles it ran (its settled_at)
    at: datetime


@dataclass(frozen=True)
class TaskWrite:
    """What the steps write to the task's row: usage, and a status from an active one."""

    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    status: str | None = None
    #: the status is running or waiting: record when the task started, if not yet
    running: bool = False


@dataclass(frozen=True)
class FusedCommit:
    run: RunBefore
    after: RunAfter
    #: the committing worker (the transitions' worker, the settles' settled_by)
    owner: str
    now: datetime
    records: list[Record]
    #: the turn whose items, calls and settles these are
    turn: int
    #: the task's status and timeout as the steps' boundaries saw them
    task_status: str
    task_timeout_at: datetime | None
    task_write: TaskWrite | None = None
    #: transcript items: seq, kind, call_id, payload
    items: list[tuple[int, str, str | None, Any]] = field(default_factory=list)
    #: new tool_calls rows, whole (their queue and start applied)
    calls: list[dict[str, Any]] = field(default_factory=list)
    settles: list[Settle] = field(default_factory=list)
    #: the finishing order of the turn's calls settled before this commit (call id, order):
    #: they must be settled (I7: the results written are theirs)
    orders: list[tuple[str, int]] = field(default_factory=list)
    #: the number of calls the turn must have (None: not checked)
    turn_calls: int | None = None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@functools.cache
def _statement(
    carried: bool,
    state: bool,
    items: bool,
    calls: bool,
    settles: bool,
    turn_calls: bool,
    task_write: bool,
    orders: bool = False,
) -> str:
    """The fused statement for one shape, built once. Every later CTE reads ``run``, so it
    writes nothing unless the run's compare-and-set matched, and runs after it (the run's row
    locked first, then the calls, then the task: the order of every writer)."""
    ctes = [_run_cte(carried, state)]
    if items:
        ctes.append(_WRITTEN)
    if calls:
        ctes.append(_INSERTED)
    if settles:
        ctes.append(_SETTLED)
    if orders:
        ctes.append(_ORDERED)
    task_now, task_ok = _task_cte(task_write, _task_after(settles, orders))
    ctes.append(task_now)
    ctes.append(_checked_cte(task_ok, settles, orders, turn_calls))
    # (_RECORDED reads checked: the check runs whatever plan the statement gets)
    ctes.append(_RECORDED)
    return _compact("WITH " + ",\n    ".join(ctes) + _RESULT)


#: a SQL string literal ('' inside one is a quote)
_LITERAL = re.compile(r"'(?:[^']|'')*'")


def _compact(sql: str) -> str:
    """``sql`` with each run of whitespace one space. Shorter to send, and short enough that
    psycopg caches its parse of the placeholders: it parses a statement longer than 4,096 bytes
    again at every execution (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH), and a steady
    turn's two shapes are longer than that as written. That changes nothing the statement
    says only while it holds no comment (a ``--`` one would swallow the rest of the joined
    line) and no literal holding whitespace (it would be changed): checked here, once per
    shape (_statement is cached), so a statement written otherwise fails at once."""
    if "--" in sql or "/*" in sql:
        raise ValueError("a fused statement holds a comment: its whitespace cannot be collapsed")
    spaced = [text for text in _LITERAL.findall(sql) if any(c.isspace() for c in text)]
    if spaced:
        raise ValueError(
            f"a fused statement holds a literal with whitespace ({spaced[0]}): its whitespace "
            "cannot be collapsed"
        )
    return " ".join(sql.split())


def _run_cte(carried: bool, state: bool) -> str:
    """The run's compare-and-set: every step's moves of its row at once."""
    return f"""run AS (
        UPDATE executions SET
            phase = %(to)s, version = version + %(steps)s, turn = turn + %(turns)s,
            next_seq = next_seq + %(n_items)s,{" state = %(state)s::jsonb," if state else ""}
            model_calls = model_calls + %(model_calls)s,
            model_repeats = model_repeats + %(model_repeats)s,
            lease_owner = %(next_owner)s::varchar, lease_until = %(next_until)s::timestamptz,
            attempts = %(next_attempts)s, wake_at = %(wake_at)s::timestamptz,
            error = 'null'::jsonb, updated_at = %(now)s, swept_at = NULL
        WHERE id = %(id)s AND phase = %(from)s AND version = %(version)s
            {_run_claim(carried)}
        RETURNING id, task_id, inbox, model_calls
    )"""


def _run_claim(carried: bool) -> str:
    """The lease the run's row must have: this worker's for a claim it carried, else free to
    claim and as the first step's claim was predicted (RunBefore)."""
    if carried:
        return "AND lease_owner = %(owner)s"
    return """AND (lease_until IS NULL OR lease_until < %(now)s)
            AND attempts = %(attempts)s AND inbox = %(inbox)s AND turn = %(turn0)s
            AND next_seq = %(next_seq)s AND state = %(state0)s::jsonb
            AND COALESCE(error, 'null'::jsonb) = 'null'::jsonb"""


_WRITTEN = """written AS (
        INSERT INTO transcript_items (execution_id, seq, turn, kind, call_id, payload, created_at)
        SELECT run.id, x.seq, %(turn)s, x.kind, x.call_id, x.payload -> 'v', %(now)s
        FROM run, jsonb_to_recordset(%(items)s::jsonb)
            AS x(seq int, kind text, call_id text, payload jsonb)
    )"""

_INSERTED = """inserted AS (
        INSERT INTO tool_calls (execution_id, call_id, turn, idx, name, arguments, effect,
            resumable, state, attempts, outcome, result, settled_at, settled_by, late_reports,
            hold, hold_info, on_interrupt, queued_at, dispatch_version, deadline_at,
            started_at, started_by, lease_owner, lease_until, implementation)
        SELECT run.id, x.call_id, %(turn)s, x.idx, x.name, x.arguments -> 'v', x.effect,
            x.resumable, x.state, x.attempts, x.outcome, x.result -> 'v', x.settled_at,
            x.settled_by, 0, x.hold, x.hold_info -> 'v', x.on_interrupt, x.queued_at,
            x.dispatch_version, x.deadline_at, x.started_at, x.started_by, x.lease_owner,
            x.lease_until, x.implementation
        FROM run, jsonb_to_recordset(%(calls)s::jsonb) AS x(call_id text, idx int, name text,
            arguments jsonb, effect text, resumable boolean, state text, attempts int,
            outcome text, result jsonb, settled_at timestamptz, settled_by text, hold text,
            hold_info jsonb, on_interrupt text, queued_at timestamptz, dispatch_version int,
            deadline_at timestamptz, started_at timestamptz, started_by text, lease_owner text,
            lease_until timestamptz, implementation text)
    )"""

_SETTLED = """settled AS (
        UPDATE tool_calls c SET state = 'settled', outcome = x.outcome, result = x.result -> 'v',
            settled_at = x.at, settled_by = %(owner)s, lease_owner = NULL,
            lease_until = NULL, duration_ms = x.duration_ms, hold = NULL,
            finish_order = x.finish_order
        FROM run, jsonb_to_recordset(%(settles)s::jsonb) AS x(call_id text, outcome text,
            result jsonb, duration_ms float8, finish_order int, token int, at timestamptz)
        WHERE c.execution_id = run.id AND c.turn = %(turn)s AND c.call_id = x.call_id
            AND c.state = 'started' AND c.lease_owner = %(owner)s AND c.attempts = x.token
            AND c.hold IS NULL
        RETURNING c.call_id
    )"""

_ORDERED = """ordered AS (
        UPDATE tool_calls c SET finish_order = x.n
        FROM run, jsonb_to_recordset(%(orders)s::jsonb) AS x(call_id text, n int)
        WHERE c.execution_id = run.id AND c.turn = %(turn)s AND c.call_id = x.call_id
            AND c.state = 'settled'
        RETURNING c.call_id
    )"""


def _task_after(settles: bool, orders: bool) -> str:
    """The FROM list the task's part reads: the run, and what must be written before it."""
    after = "run"
    if settles:
        # the task after the calls: an aggregate over the settle makes it run first
        after = "run, (SELECT count(*) AS n FROM settled) AS settled_first"
    if orders:
        after += ", (SELECT count(*) AS n FROM ordered) AS ordered_first"
    return after


#: What a fused commit returns of its task (runs.Fresh), in this order, whether the statement
#: wrote it or a read-back after a lost connection reads it: one definition for both, so a
#: budget's tokens and the delegated flag are read back as the commit returns them (I1, I3,
#: I31). (delegated: whether the task has started a child, store.runs._DELEGATED)
_FRESH_TASK = ("status", "timeout_at", "budget", *TOKEN_COLUMNS, "delegated")
_DELEGATED = "EXISTS (SELECT 1 FROM tasks child WHERE child.parent_id = t.id)"
_TASK_RETURNED = ", ".join(
    [f"t.{name}" for name in _FRESH_TASK[:-1]] + [f"{_DELEGATED} AS delegated"]
)
#: ... and of its run
_FRESH_RUN = ("inbox", "model_calls")


def _fresh_array(run: str, task: str, delegated: str) -> str:
    """``_FRESH_RUN`` then ``_FRESH_TASK`` as one JSON array: a row of one column is read for a
    fraction of the CPU of a row of a dozen (a driver's and SQLAlchemy's work per column, at
    every turn's two commits), and its one type (json) survives a migration that changes a
    returned column's: a statement prepared on the server fails at every execution once the
    types of what it returns change (0A000, "cached plan must not change result type")."""
    values = [f"{run}.{name}" for name in _FRESH_RUN]
    values += [f"{task}.{name}" for name in _FRESH_TASK[:-1]] + [delegated]
    return f"json_build_array({', '.join(values)})"


def _task_cte(task_write: bool, after: str) -> tuple[str, str]:
    """``task_now``, the task's row as it is now (written, or read under a share lock), and
    the check that it is as the steps' boundaries saw it."""
    if task_write:
        return _task_written(after), "(SELECT count(*) FROM task_now) = 1"
    # A locking read returns the row as it is now, not as the statement's snapshot had it.
    cte = f"""task_now AS (
        SELECT {_TASK_RETURNED} FROM tasks t, {after} WHERE t.id = run.task_id FOR SHARE OF t
    )"""
    task_ok = """EXISTS (SELECT 1 FROM task_now WHERE status = %(task_status)s
            AND timeout_at IS NOT DISTINCT FROM %(task_timeout)s::timestamptz)"""
    return cte, task_ok


def _task_written(after: str) -> str:
    """``task_now`` as the steps' write of the task's row (TaskWrite) returns it."""
    # The task's own UPDATE waits for a concurrent writer and re-reads its row: its WHERE
    # is the check, on the row as it is now.
    active = ", ".join(f"'{s}'" for s in ACTIVE)
    return f"""task_now AS (
        UPDATE tasks t SET
            input_tokens = t.input_tokens + %(input_tokens)s,
            output_tokens = t.output_tokens + %(output_tokens)s,
            reasoning_tokens = t.reasoning_tokens + %(reasoning_tokens)s,
            cache_read_tokens = t.cache_read_tokens + %(cache_read_tokens)s,
            cache_write_tokens = t.cache_write_tokens + %(cache_write_tokens)s,
            status = CASE WHEN t.status IN ({active})
                THEN COALESCE(%(status)s::varchar, t.status) ELSE t.status END,
            started_at = CASE WHEN %(running)s AND t.status IN ({active})
                THEN COALESCE(t.started_at, %(now)s) ELSE t.started_at END
        FROM {after}
        WHERE t.id = run.task_id AND t.status = %(task_status)s
            AND t.timeout_at IS NOT DISTINCT FROM %(task_timeout)s::timestamptz
        RETURNING {_TASK_RETURNED}
    )"""


def _checked_cte(task_ok: str, settles: bool, orders: bool, turn_calls: bool) -> str:
    """Every assumption in one ``charlie_expect``, which raises (CH001) when one failed."""
    checks = [task_ok]
    if settles:
        checks.append("(SELECT count(*) FROM settled) = %(n_settles)s")
    if orders:
        checks.append("(SELECT count(*) FROM ordered) = %(n_orders)s")
    if turn_calls:
        checks.append(
            "(SELECT count(*) FROM tool_calls WHERE execution_id = %(id)s AND turn = %(turn)s)"
            " = %(turn_calls)s"
        )
    return f"""checked AS (
        SELECT charlie_expect({" AND ".join(checks)}, %(what)s) AS ok FROM run
    )"""


# The check must run whatever plan the statement gets: a SELECT in a WITH runs only when
# something reads it, and the data-modifying ones always run to completion. This INSERT
# reads it for the run's row (the transitions are never none), so a failed assumption
# raises before anything is committed; the final SELECT alone would not be enough (a
# plan that reads an empty task_now first never reaches it, a review found).
_RECORDED = """recorded AS (
        INSERT INTO transitions
            (execution_id, from_phase, to_phase, version, at, worker, duration_ms, note)
        SELECT run.id, x.from_phase, x.to_phase, x.version, x.at, %(owner)s, x.duration_ms,
            x.note
        FROM run, checked, jsonb_to_recordset(%(records)s::jsonb) AS x(n int, from_phase text,
            to_phase text, version int, at timestamptz, duration_ms float8, note text)
        WHERE checked.ok
        ORDER BY x.n
    )"""

#: What commit_fused returns (runs.Fresh): the run's and the task's rows as the statement left
#: them
_RESULT = f"""
    SELECT {_fresh_array("run", "t", "t.delegated")} AS fresh
    FROM run, checked, task_now t"""

_TOKENS_AT = len(_FRESH_RUN) + _FRESH_TASK.index(TOKEN_COLUMNS[0])


def _fresh(values: list[Any], task_id: str) -> Fresh:
    """runs.Fresh from ``_fresh_array``'s values (the commit's, or its read-back's)."""
    inbox, model_calls, status, timeout_at, budget = values[:_TOKENS_AT]
    return Fresh(
        inbox,
        model_calls,
        status,
        # a timestamptz in JSON is ISO 8601 with the session's offset, to the microsecond
        None if timeout_at is None else datetime.fromisoformat(timeout_at).astimezone(UTC),
        budget,
        task_id,
        tuple(values[_TOKENS_AT : _TOKENS_AT + len(TOKEN_COLUMNS)]),
        delegated=bool(values[-1]),
    )


def _wrapped(value: Any) -> dict[str, Any]:
    return {"v": value}


def _params(fused: FusedCommit) -> dict[str, Any]:
    run, after = fused.run, fused.after
    params: dict[str, Any] = {
        "id": run.execution_id,
        "from": run.phase.value,
        "version": run.version,
        "owner": fused.owner,
        "now": fused.now,
        "to": after.phase.value,
        "steps": after.steps,
        "turns": after.turns,
        "n_items": after.items,
        "model_calls": after.model_calls,
        "model_repeats": after.model_repeats,
        "next_owner": fused.owner if after.lease_until is not None else None,
        "next_until": after.lease_until,
        "next_attempts": 1 if after.lease_until is not None else 0,
        "wake_at": after.wake_at,
        "turn": fused.turn,
        "task_status": fused.task_status,
        "task_timeout": fused.task_timeout_at,
        "records": json.dumps(
            [
                {
                    "n": n,
                    "from_phase": r.from_phase.value,
                    "to_phase": r.to_phase.value,
                    "version": r.version,
                    "at": r.at.isoformat(),
                    "duration_ms": r.duration_ms,
                    "note": r.note,
                }
                for n, r in enumerate(fused.records)
            ]
        ),
        "what": (
            f"run {run.execution_id} from {run.phase.value} v{run.version}: its calls or its "
            "task are not as its steps assumed"
        ),
    }
    if after.state is not None:
        params["state"] = json.dumps(after.state)
    if run.owner is None:
        params.update(
            attempts=run.attempts,
            inbox=run.inbox,
            turn0=run.turn,
            next_seq=run.next_seq,
            state0=json.dumps(run.state),
        )
    if fused.items:
        params["items"] = json.dumps(
            [
                {"seq": seq, "kind": kind, "call_id": call_id, "payload": _wrapped(payload)}
                for seq, kind, call_id, payload in fused.items
            ]
        )
    if fused.calls:
        rows = []
        for row in fused.calls:
            out = dict(row)
            for key in ("arguments", "result", "hold_info"):
                out[key] = _wrapped(row.get(key))
            for key in ("settled_at", "queued_at", "deadline_at", "started_at", "lease_until"):
                out[key] = _iso(row.get(key))
            rows.append(out)
        params["calls"] = json.dumps(rows)
    if fused.settles:
        params["settles"] = json.dumps(
            [
                {
                    "call_id": s.call_id,
                    "outcome": s.outcome,
                    "result": _wrapped(s.result),
                    "duration_ms": s.duration_ms,
                    "finish_order": s.finish_order,
                    "token": s.token,
                    "at": s.at.isoformat(),
                }
                for s in fused.settles
            ]
        )
        params["n_settles"] = len(fused.settles)
    if fused.orders:
        params["orders"] = json.dumps([{"call_id": c, "n": n} for c, n in fused.orders])
        params["n_orders"] = len(fused.orders)
    if fused.turn_calls is not None:
        params["turn_calls"] = fused.turn_calls
    if fused.task_write is not None:
        w = fused.task_write
        params.update(
            input_tokens=w.input_tokens,
            output_tokens=w.output_tokens,
            reasoning_tokens=w.reasoning_tokens,
            cache_read_tokens=w.cache_read_tokens,
            cache_write_tokens=w.cache_write_tokens,
            status=w.status,
            running=w.running,
        )
    return params


def commit_fused(conn: Connection, fused: FusedCommit) -> Fresh | None:
    """Write ``fused`` in one statement, in ``conn``'s autocommit. Returns what the last step's
    claim needs of the run and task as they are now (runs.Fresh), or None when nothing was
    written: the run's row was not as assumed, an assumption failed, or a value could not be
    sent as JSON (the caller then writes the steps the ordinary way, whose own compare-and-set
    decides what stands). Raises :class:`OutcomeUnknown` on any other error: the caller reads
    the outcome back (:func:`fused_outcome`), never assuming nothing was written."""
    assert conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    try:
        params = _params(fused)
    except (TypeError, ValueError) as exc:  # not JSON: the ordinary path says so
        log.debug("fused commit not sent: %s", exc)
        return None
    sql = _statement(
        fused.run.owner is not None,
        "state" in params,
        bool(fused.items),
        bool(fused.calls),
        bool(fused.settles),
        fused.turn_calls is not None,
        fused.task_write is not None,
        bool(fused.orders),
    )
    context = {
        "execution_id": fused.run.execution_id,
        "phase": fused.run.phase.value,
        "version": fused.run.version,
    }
    try:
        # prepared on the server where the connection allows it: the same few shapes each turn
        row = conn.exec_driver_sql(sql, params, execution_options=PREPARED_EXECUTION).first()
        _fault_after_commit(conn, fused)
    except DBAPIError as exc:
        if sqlstate(exc) == ASSUMPTION_FAILED:
            # Something happened meanwhile (a cancel, a settle by a sweep, ...): the ordinary
            # path reads what.
            log.info(
                "fused commit not applied (its calls or task changed); writing the steps one "
                "by one",
                extra=context,
            )
            return None
        # Any other error leaves the outcome unknown: a connection lost once the server had
        # committed looks like one lost before. The caller reads it back (fused_outcome).
        log.warning("fused commit's outcome unknown; reading it back", extra=context, exc_info=True)
        raise OutcomeUnknown(str(getattr(exc, "orig", None) or exc)) from exc
    if row is None:
        log.info(
            "fused commit not applied (the run's row is not as predicted); writing the steps "
            "one by one",
            extra=context,
        )
        return None
    return _fresh(row.fresh, fused.run.task_id)


class OutcomeUnknown(Exception):
    """The fused statement raised something other than a failed assumption (a connection lost,
    an error from its commit): it may have committed or not. Never assumed either way: the
    caller settles it by reading back (:func:`fused_outcome`)."""


def _fault_after_commit(conn: Connection, fused: FusedCommit) -> None:
    """Fault point ``store.fused.after_commit`` (tests, chaos): the server has committed the
    statement; an injected fault here terminates this connection's backend for real, so the
    worker hears the driver's own error for a connection lost after the commit."""
    try:
        faults.hit(
            "store.fused.after_commit",
            task_id=fused.run.task_id,
            phase=fused.run.phase.value,
            turn=fused.run.turn,
        )
    except faults.InjectedFault:
        conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")


#: Wait for any writer of the run's row to end (a fused statement whose connection was lost
#: may still be running on the server): its lock is held until it commits or rolls back.
_AWAIT_RUN = "SELECT version FROM executions WHERE id = %(id)s FOR UPDATE"

#: Whether a fused commit went through: its first step's ``transitions`` row, written by this
#: worker at that step's own time, exists (nothing else writes that row); and what the last
#: step's claim needs of the run and task as they are now (runs.Fresh).
_READ_BACK = f"""
SELECT {_fresh_array("e", "t", _DELEGATED)} AS fresh,
    EXISTS (SELECT 1 FROM transitions r WHERE r.execution_id = e.id
        AND r.version = %(version)s AND r.worker = %(owner)s AND r.at = %(at)s) AS applied
FROM executions e JOIN tasks t ON t.id = e.task_id
WHERE e.id = %(id)s
"""


def fused_outcome(conn: Connection, fused: FusedCommit) -> Fresh | None:
    """After :class:`OutcomeUnknown`, in ``conn``'s autocommit: what :func:`commit_fused` would
    have returned had it heard the answer (a Fresh: committed; None: nothing written)."""
    assert conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    conn.exec_driver_sql(_AWAIT_RUN, {"id": fused.run.execution_id}).first()
    first = fused.records[0]
    row = conn.exec_driver_sql(
        _READ_BACK,
        {
            "id": fused.run.execution_id,
            "version": first.version,
            "owner": fused.owner,
            "at": first.at,
        },
    ).first()
    if row is None or not row.applied:
        log.info(
            "fused commit read back: not applied; writing the steps one by one",
            extra={"execution_id": fused.run.execution_id, "version": fused.run.version},
        )
        return None
    log.warning(
        "fused commit read back: it was committed before its connection was lost",
        extra={"execution_id": fused.run.execution_id, "version": fused.run.version},
    )
    return _fresh(row.fresh, fused.run.task_id)


#: A holder's settle of one call with what every settler does around it (store.calls.
#: settle_in_turn): the run's row locked first, then the call, then the turn's other open
#: calls counted by a locking read, which sees the latest commit of each (a settler that
#: committed while this one waited for the run's lock), not the statement's snapshot; and, when
#: that completes the turn of a run in await_tools, the run's wake-up a stall period ahead
#: (store.calls.await_version_if_complete: the sweeps find a lost await tick by it).
_SETTLE_HELD = """
WITH run AS (
    SELECT id, phase, version FROM executions WHERE id = %(execution)s FOR UPDATE
), settled AS (
    UPDATE tool_calls c SET state = 'settled', outcome = %(outcome)s,
        result = %(result)s::jsonb, settled_at = %(now)s, settled_by = %(owner)s,
        lease_owner = NULL, lease_until = NULL, duration_ms = %(duration)s, hold = NULL
    FROM run
    WHERE c.execution_id = run.id AND c.turn = %(turn)s AND c.call_id = %(call)s
        AND c.state <> 'settled' AND c.lease_owner = %(owner)s AND c.attempts = %(token)s
    RETURNING c.call_id
), still_open AS (
    SELECT c.call_id FROM tool_calls c, (SELECT count(*) AS n FROM settled) AS settled_first
    WHERE c.execution_id = %(execution)s AND c.turn = %(turn)s AND c.call_id <> %(call)s
        AND c.state <> 'settled'
    FOR SHARE OF c
), woken AS (
    UPDATE executions e SET wake_at = %(recheck)s
    FROM run
    WHERE e.id = run.id AND run.phase = 'await_tools'
        AND EXISTS (SELECT 1 FROM settled) AND NOT EXISTS (SELECT 1 FROM still_open)
    RETURNING e.id
)
SELECT run.phase, run.version, (SELECT count(*) FROM still_open) AS open
FROM run WHERE EXISTS (SELECT 1 FROM settled)
"""


@dataclass(frozen=True)
class HeldSettle:
    """A holder's settle that went through, and what its settler must know after it."""

    phase: str
    version: int
    #: the turn's calls still open once this one settled
    still_open: int


def settle_held(
    conn: Connection,
    execution_id: str,
    turn: int,
    call_id: str,
    outcome: str,
    result: Any,
    owner: str,
    now: datetime,
    duration_ms: float | None,
    token: int,
    recheck_at: datetime,
) -> HeldSettle | None:
    """A worker's settle of the call it holds (calls.SETTLE_HELD) in one statement, in
    ``conn``'s autocommit. None when it settled nothing (the call was settled meanwhile, or
    taken over): nothing was written, and the caller settles the ordinary way, which records
    the late report or finds its own earlier commit."""
    assert conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    try:
        encoded = json.dumps(result)
    except (TypeError, ValueError):
        return None
    row = conn.exec_driver_sql(
        _SETTLE_HELD,
        {
            "execution": execution_id,
            "turn": turn,
            "call": call_id,
            "outcome": outcome,
            "result": encoded,
            "now": now,
            "owner": owner,
            "duration": duration_ms,
            "token": token,
            "recheck": recheck_at,
        },
    ).first()
    return None if row is None else HeldSettle(row.phase, row.version, int(row.open))
