"""Core statements for executions, transcripts and transitions: the tick's reads and writes.

Every state change is a compare-and-set on the row's version and lease (I1, I2): a statement
that matches no row means another worker or a newer message got there first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    Connection,
    Integer,
    String,
    bindparam,
    case,
    exists,
    func,
    insert,
    or_,
    select,
    true,
    update,
)

from charlie.domain import (
    JSON,
    CallState,
    CallView,
    Effect,
    Hold,
    Item,
    ItemKind,
    Message,
    Outcome,
    Phase,
    TaskStatus,
    TaskView,
    Transition,
)
from charlie.store import calls
from charlie.store.engine import database_identity
from charlie.store.schema import (
    executions,
    messages,
    tasks,
    tool_calls,
    transcript_items,
    transitions,
)
from charlie.store.transcripts import as_stored

ACTIVE = (TaskStatus.QUEUED.value, TaskStatus.RUNNING.value, TaskStatus.WAITING.value)


@dataclass(frozen=True)
class Claim:
    """An execution row as claimed by this worker for one tick, with its task."""

    execution_id: str
    task_id: str
    phase: Phase
    version: int
    turn: int
    next_seq: int
    state: JSON
    attempts: int
    #: the error an earlier attempt of this tick recorded (a refused write), if any.
    last_error: JSON | None = None
    #: the task as it stood at the claim (its status decides whether the run stops).
    task: TaskView | None = None
    #: messages waiting in the run's mailbox (I22): the boundary loads them only if any.
    inbox: int = 0
    #: which run this is, beyond its id: the database the claim was read from (engine.
    #: database_identity, per connection) and the run row's creation time (its incarnation).
    #: What this process remembers of a run's transcript is kept under it (store.transcripts),
    #: so a recreated database, a restored backup or a task id used again never serves the
    #: items of another run under the same id.
    identity: tuple[object, datetime | None] = (None, None)
    #: the task's priority (read with the claim, as the task's other columns): the messages
    #: the step publishes carry it (runtime.Publisher)
    priority: int = 0


# The hot path's statements are built once: building a Core statement costs about as much
# CPU as the database takes to run it. Values come in as bind parameters.
_e = executions.c
_t = tasks.c


def _task_column(column: Any) -> Any:
    # The task row rides along in the claim's RETURNING as scalar subqueries (PostgreSQL and
    # SQLite both allow them): one round trip instead of a claim and a SELECT.
    return select(column).where(_t.id == _e.task_id).scalar_subquery().label(column.key)


_TASK_COLUMNS = (
    _t.prompt,
    _t.model,
    _t.tools,
    _t.metadata,
    _t.status,
    _t.parent_id,
    _t.timeout_at,
    _t.approve,
)


def _claim_statement(*extra: Any) -> Any:
    return (
        update(executions)
        .where(
            _e.id == bindparam("b_id"),
            _e.phase == bindparam("b_phase"),
            _e.version == bindparam("b_version"),
            or_(
                _e.lease_until.is_(None),
                _e.lease_until < bindparam("b_now", type_=_e.lease_until.type),
            ),
        )
        .values(
            lease_owner=bindparam("b_owner"),
            lease_until=bindparam("b_until", type_=_e.lease_until.type),
            attempts=_e.attempts + 1,
            wake_at=None,
        )
        .returning(
            _e.task_id,
            _e.turn,
            _e.next_seq,
            _e.state,
            _e.attempts,
            _e.error,
            _e.inbox,
            _e.created_at,
            # the task's priority, for the messages this step publishes (runtime.Publisher)
            _task_column(_t.priority),
            *(_task_column(column) for column in _TASK_COLUMNS),
            *extra,
        )
    )


_child = tasks.alias("child")
# Whether the task has started a child (delegate): a budget then counts its children's spend
# too (store.spend). An index probe, read only where the budget is: call_model's claim, and a
# move that claims its next step.
_DELEGATED = select(_child.c.id).where(_child.c.parent_id == _t.id).exists().label("delegated")

#: the task's columns that change while its run runs (a stop, a resume's timeout, a budget, a
#: first child)
_FRESH_TASK_COLUMNS = (_t.status, _t.timeout_at, _t.budget, _DELEGATED)

_CLAIM = _claim_statement()
# call_model's claim, the one boundary that checks a budget: the budget rides along
# as one more scalar subquery, and the run's model-call count as a plain column; a task's
# tokens are read (one more statement) only when its budget counts them. Other phases' claims
# carry neither.
_CLAIM_MODEL = _claim_statement(
    _task_column(_t.budget),
    select(_child.c.id).where(_child.c.parent_id == _e.task_id).exists().label("delegated"),
    _e.model_calls,
)
#: the task's token counts, as the usage a budget counts names them
TOKEN_COLUMNS = (
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
)
_LOAD_TOKENS = select(
    _t.input_tokens,
    _t.output_tokens,
    _t.reasoning_tokens,
    _t.cache_read_tokens,
    _t.cache_write_tokens,
).where(_t.id == bindparam("b_task"))


def claim_execution(
    conn: Connection,
    execution_id: str,
    phase: Phase,
    version: int,
    owner: str,
    now: datetime,
    lease_seconds: float,
) -> Claim | None:
    """Take the lease on the row if it is still at (phase, version) and nobody live holds it.

    ``None`` is a stale or duplicate message (I2)."""
    model = phase is Phase.CALL_MODEL
    row = conn.execute(
        _CLAIM_MODEL if model else _CLAIM,
        {
            "b_id": execution_id,
            "b_phase": phase.value,
            "b_version": version,
            "b_now": now,
            "b_owner": owner,
            "b_until": now + timedelta(seconds=lease_seconds),
        },
    ).first()
    if row is None:
        return None
    # The foreign key makes a missing task unlikely, not impossible.
    task = _task_view(row.task_id, row) if row.status is not None else None
    if task is not None and model and row.budget:
        task = replace(
            task, budget=row.budget, usage=_usage(conn, row), delegated=bool(row.delegated)
        )
    return Claim(
        execution_id,
        row.task_id,
        phase,
        version,
        row.turn,
        row.next_seq,
        row.state,
        row.attempts,
        row.error,
        task,
        row.inbox,
        (database_identity(conn), row.created_at),
        row.priority or 0,
    )


def _usage(conn: Connection | None, row: Any) -> JSON:
    """The durable usage a budget counts: the run's model calls (in the claim), and the task's
    tokens when the budget has a tokens or usd limit."""
    usage: JSON = {"model_calls": row.model_calls}
    if any(row.budget.get(k) is not None for k in ("tokens", "usd")):
        known = getattr(row, "tokens", None)
        if known is not None:
            usage.update(zip(TOKEN_COLUMNS, known, strict=True))
            return usage
        assert conn is not None
        tokens = conn.execute(_LOAD_TOKENS, {"b_task": row.task_id}).one()
        usage.update({name: getattr(tokens, name) for name in TOKEN_COLUMNS})
    return usage


def renew_execution_lease(
    conn: Connection, execution_id: str, version: int, owner: str, until: datetime
) -> bool:
    e = executions.c
    stmt = (
        update(executions)
        .where(e.id == execution_id, e.version == version, e.lease_owner == owner)
        .values(lease_until=until)
    )
    return conn.execute(stmt).rowcount == 1


def transition_recorded(
    conn: Connection, execution_id: str, version: int, owner: str, at: datetime
) -> bool:
    """After a COMMIT whose answer was lost: whether it went through. Its transition's own row
    (the step that made the run's ``version``, written by ``owner`` at ``at``: nothing else
    writes that row) exists or not. The run's row is locked first, so a COMMIT the server is
    still running (its connection gone) ends before the row is looked for."""
    conn.execute(
        select(executions.c.version).where(executions.c.id == execution_id).with_for_update()
    ).first()
    r = transitions.c
    found = conn.execute(
        select(r.id).where(
            r.execution_id == execution_id, r.version == version, r.worker == owner, r.at == at
        )
    ).first()
    return found is not None


def task_view(row: Any) -> TaskView:
    return _task_view(row.id, row)


def _task_view(task_id: str, row: Any) -> TaskView:
    return TaskView(
        id=task_id,
        prompt=row.prompt,
        model=row.model,
        tools=row.tools,
        metadata=row.metadata or {},
        status=TaskStatus(row.status),
        parent_id=row.parent_id,
        timeout_at=row.timeout_at,
        approve=getattr(row, "approve", None),
    )


def load_task(conn: Connection, task_id: str) -> TaskView | None:
    t = tasks.c
    row = conn.execute(
        select(
            t.id, t.prompt, t.model, t.tools, t.metadata, t.status, t.parent_id, t.timeout_at
        ).where(t.id == task_id)
    ).first()
    return task_view(row) if row else None


_i = transcript_items.c
_LOAD_ITEMS = (
    select(_i.seq, _i.turn, _i.kind, _i.call_id, _i.payload)
    .where(_i.execution_id == bindparam("b_execution"))
    .order_by(_i.seq)
)


_LOAD_ITEMS_FROM = _LOAD_ITEMS.where(_i.seq >= bindparam("b_from"))


_RESULT_OF = (
    select(_i.payload)
    .where(
        _i.execution_id == bindparam("b_execution"),
        _i.kind == ItemKind.TOOL_RESULT.value,
        _i.call_id == bindparam("b_call"),
    )
    .order_by(_i.seq)
    .limit(1)
)


def recorded_result(conn: Connection, execution_id: str, call_id: str) -> JSON | None:
    """The ``tool_result`` payload the run's transcript holds for ``call_id`` (the record
    keeps every result whole, whatever the model input showed of it, I29)."""
    row = conn.execute(_RESULT_OF, {"b_execution": execution_id, "b_call": call_id}).first()
    return row.payload if row else None


def load_items(conn: Connection, execution_id: str, known: Sequence[Item] = ()) -> list[Item]:
    """The run's transcript. ``known``: a prefix of it already read (seq 0 ...): only the items
    after it are read."""
    if known:
        rows = conn.execute(_LOAD_ITEMS_FROM, {"b_execution": execution_id, "b_from": len(known)})
    else:
        rows = conn.execute(_LOAD_ITEMS, {"b_execution": execution_id})
    return [*known, *(Item(r.seq, r.turn, ItemKind(r.kind), r.call_id, r.payload) for r in rows)]


def written_items(
    conn: Connection | str, claim: Claim, transition: Transition
) -> list[Item] | None:
    """The items ``commit_transition`` inserted for this transition, as the table returns them
    (transcripts.as_stored), or None when that cannot be predicted. ``conn``: the connection
    that wrote them, or its dialect's name."""
    dialect = conn if isinstance(conn, str) else conn.dialect.name
    items = []
    for n, item in enumerate(transition.items):
        ok, payload = as_stored(item.payload, dialect)
        if not ok:
            return None
        items.append(Item(claim.next_seq + n, claim.turn, item.kind, item.call_id, payload))
    return items


_m = messages.c
_PENDING_MESSAGES = (
    select(_m.id, _m.message_id, _m.text, _m.sent_by)
    .where(_m.task_id == bindparam("b_task"), _m.delivered_seq.is_(None))
    .order_by(_m.id)
)


def load_messages(conn: Connection, task_id: str) -> list[Message]:
    """The task's messages not yet taken in, in commit order (sends to one task serialize on
    its run's row, so their ids are in commit order: see store.people.add_message)."""
    rows = conn.execute(_PENDING_MESSAGES, {"b_task": task_id})
    return [Message(r.id, r.message_id, r.text, r.sent_by) for r in rows]


_DELIVER = (
    update(messages)
    .where(_m.id == bindparam("b_message"), _m.delivered_seq.is_(None))
    .values(
        delivered_seq=bindparam("b_seq"),
        delivered_turn=bindparam("b_turn"),
        delivered_at=bindparam("b_now", type_=_m.delivered_at.type),
    )
)


def call_view(r: Any) -> CallView:
    return CallView(
        call_id=r.call_id,
        turn=r.turn,
        index=r.idx,
        name=r.name,
        arguments=r.arguments,
        state=CallState(r.state),
        outcome=Outcome(r.outcome) if r.outcome else None,
        result=r.result,
        queued_at=r.queued_at,
        started_at=r.started_at,
        settled_at=r.settled_at,
        deadline_at=r.deadline_at,
        lease_owner=r.lease_owner,
        attempts=r.attempts,
        hold=Hold(r.hold) if r.hold else None,
        hold_info=r.hold_info,
        settled_by=r.settled_by,
    )


CALL_COLUMNS = (
    tool_calls.c.call_id,
    tool_calls.c.turn,
    tool_calls.c.idx,
    tool_calls.c.name,
    tool_calls.c.arguments,
    tool_calls.c.state,
    tool_calls.c.outcome,
    tool_calls.c.result,
    tool_calls.c.queued_at,
    tool_calls.c.started_at,
    tool_calls.c.settled_at,
    tool_calls.c.deadline_at,
    tool_calls.c.lease_owner,
    tool_calls.c.attempts,
    tool_calls.c.hold,
    tool_calls.c.hold_info,
    tool_calls.c.settled_by,
)


_LOAD_CALLS = (
    select(*CALL_COLUMNS)
    .where(
        tool_calls.c.execution_id == bindparam("b_execution"),
        tool_calls.c.turn == bindparam("b_turn"),
    )
    .order_by(tool_calls.c.idx)
)
# FOR UPDATE on PostgreSQL; SQLite's writes are serialized by BEGIN IMMEDIATE anyway.
_LOCK_CALLS = _LOAD_CALLS.with_for_update()


def load_calls(
    conn: Connection, execution_id: str, turn: int, *, lock: bool = False
) -> list[CallView]:
    rows = conn.execute(
        _LOCK_CALLS if lock else _LOAD_CALLS, {"b_execution": execution_id, "b_turn": turn}
    )
    return [call_view(r) for r in rows]


@functools.cache
def _commit_statement(
    moving: bool,
    state: bool,
    items: bool,
    next_turn: bool,
    usage: bool,
    error: bool,
    mail: bool = False,
    claim_next: bool = False,
) -> Any:
    """The execution row's compare-and-set for one shape of transition, built once.

    ``claim_next``: the move also takes the next (phase, version)'s lease for this worker, with
    its first attempt counted, as its claim would (a merged transaction's next step):
    one statement instead of two."""
    values: dict[str, Any] = {
        "lease_owner": None,
        "lease_until": None,
        "wake_at": bindparam("b_wake_at", type_=_e.wake_at.type),
        # A moving transition starts the next (phase, version) afresh; a wait that finished its
        # tick normally also resets, since the next claim is not a retry.
        "attempts": 0,
    }
    if claim_next:
        values.update(
            lease_owner=bindparam("b_next_owner"),
            lease_until=bindparam("b_next_until", type_=_e.lease_until.type),
            attempts=1,
        )
    if state:
        values["state"] = bindparam("b_state", type_=_e.state.type)
    if moving:
        values.update(
            phase=bindparam("b_to"),
            version=_e.version + 1,
            updated_at=bindparam("b_now", type_=_e.updated_at.type),
            swept_at=None,
        )
    if items:
        values["next_seq"] = _e.next_seq + bindparam("b_items")
    if next_turn:
        values["turn"] = _e.turn + 1
    if mail:
        values["inbox"] = _e.inbox - bindparam("b_taken")
    if usage:
        values["model_calls"] = _e.model_calls + bindparam("b_model_calls")
        values["model_repeats"] = _e.model_repeats + bindparam("b_model_repeats")
    if error:
        values["error"] = bindparam("b_error", type_=_e.error.type)
    else:
        # An error (a refused write) is evidence for the attempt that raised it: a commit that
        # went through (a move, or a wait that finished its tick) leaves none behind, or a later
        # poison would blame it and drop the turn's result items (I8, I17).
        values["error"] = None
    return (
        update(executions)
        .where(
            _e.id == bindparam("b_id"),
            _e.version == bindparam("b_version"),
            _e.lease_owner == bindparam("b_owner"),
        )
        .values(**values)
    )


@functools.cache
def _move_statement(
    state: bool,
    items: bool,
    next_turn: bool,
    usage: bool,
    error: bool,
    mail: bool = False,
    claim_next: bool = False,
    task: tuple[bool, bool, bool] | None = None,
    fresh: bool = False,
    finish_order: bool = False,
) -> Any:
    """PostgreSQL: the compare-and-set and the transition's record in one statement (a
    data-modifying CTE), one round trip fewer per transition. Inserts no record, and so
    reports no row, when the compare-and-set matched nothing.

    ``task``: the task's row is written in the same statement too (``_task_statement``'s
    shape: usage, status, running), only if the compare-and-set matched, after it (the run's
    row, then the task's: the order of every writer). ``finish_order``: and the turn's calls'
    finishing order (their rows are this transaction's already: advance_turn holds them)."""
    returned = [_e.id]
    if fresh:
        # (what the next step's claim would read: see claimed_next; the task's part below)
        returned += [_e.inbox, _e.model_calls, _e.task_id]
    moved = (
        _commit_statement(True, state, items, next_turn, usage, error, mail, claim_next)
        .returning(*returned)
        .cte("moved")
    )
    tr = transitions.c
    columns = [
        tr.execution_id,
        tr.from_phase,
        tr.to_phase,
        tr.version,
        tr.at,
        tr.worker,
        tr.duration_ms,
        tr.note,
    ]
    values = select(
        moved.c.id,
        bindparam("b_from", type_=tr.from_phase.type),
        bindparam("b_to2", type_=tr.to_phase.type),
        bindparam("b_next_version", type_=tr.version.type),
        bindparam("b_now2", type_=tr.at.type),
        bindparam("b_owner2", type_=tr.worker.type),
        bindparam("b_duration", type_=tr.duration_ms.type),
        bindparam("b_note", type_=tr.note.type),
    )
    # RETURNING, not rowcount: drivers do not agree on the rowcount of a statement with a CTE.
    statement: Any = insert(transitions).from_select(columns, values).returning(tr.id)
    written = None
    if task is not None:
        written = _task_statement(*task).where(exists(select(moved.c.id)))
    if fresh:
        # The task as it is once this transaction holds its row, not as the statement's
        # snapshot had it: a cancel that commits while this statement waits for a lock must be
        # seen (I18). Either the task's own write returns it (an UPDATE re-reads a row it
        # waited for) or a locking read after the run's row does (the run, then the task: the
        # order of every writer). Never both in one statement.
        recorded = statement.cte("recorded")
        if written is not None:
            task_now: Any = written.returning(*_FRESH_TASK_COLUMNS).cte("task_written")
            joined = moved.join(recorded, true()).join(task_now, true())
        else:
            task_now = (
                select(*_FRESH_TASK_COLUMNS)
                .where(_t.id == moved.c.task_id)
                .with_for_update(read=True)
                .lateral("task_now")
            )
            joined = moved.join(recorded, true()).outerjoin(task_now, true())
        statement = select(
            moved.c.inbox, moved.c.model_calls, *(task_now.c[c.key] for c in _FRESH_TASK_COLUMNS)
        ).select_from(joined)
    elif written is not None:
        statement = statement.add_cte(written.cte("task_written"))
    if finish_order:
        statement = statement.add_cte(
            _FINISH_ORDER_ALL.where(exists(select(moved.c.id))).cte("ordered")
        )
    return statement


@functools.cache
def _task_statement(usage: bool, status: bool, running: bool) -> Any:
    values: dict[str, Any] = {}
    if usage:
        values.update(
            input_tokens=_t.input_tokens + bindparam("b_input"),
            output_tokens=_t.output_tokens + bindparam("b_output"),
            reasoning_tokens=_t.reasoning_tokens + bindparam("b_reasoning"),
            cache_read_tokens=_t.cache_read_tokens + bindparam("b_cache_read"),
            cache_write_tokens=_t.cache_write_tokens + bindparam("b_cache_write"),
        )
    active = _t.status.in_(ACTIVE)
    if status:
        # A status moves only from an active one (I16, I18)...
        values["status"] = case((active, bindparam("b_status")), else_=_t.status)
    if running:
        values["started_at"] = case(
            (active, func.coalesce(_t.started_at, bindparam("b_now", type_=_t.started_at.type))),
            else_=_t.started_at,
        )
    # ...while usage counts whatever the task's status: a model call that commits after its
    # task timed out or was canceled was made and paid for, and a resumed task's budget sees it.
    return update(tasks).where(_t.id == bindparam("b_task")).values(**values)


_c = tool_calls.c
_INSERT_ITEMS = insert(transcript_items)
_INSERT_CALLS = insert(tool_calls)
_QUEUE_CALLS = (
    update(tool_calls)
    .where(calls.CALL_KEY, _c.queued_at.is_(None))
    .values(
        queued_at=bindparam("b_now", type_=_c.queued_at.type),
        dispatch_version=bindparam("b_version"),
        deadline_at=bindparam("b_at", type_=_c.deadline_at.type),
    )
)
_FINISH_ORDER = update(tool_calls).where(calls.CALL_KEY).values(finish_order=bindparam("b_order"))
# PostgreSQL, inside a move: every call's order in one statement, whatever the fan-out
_ORDERS = (
    func.unnest(
        bindparam("b_order_calls", type_=ARRAY(String)),
        bindparam("b_orders", type_=ARRAY(Integer)),
    )
    .table_valued("call_id", "n")
    .render_derived(name="orders")
)
_FINISH_ORDER_ALL = (
    update(tool_calls)
    .where(
        _c.execution_id == bindparam("b_id"),
        _c.turn == bindparam("b_order_turn"),
        _c.call_id == _ORDERS.c.call_id,
    )
    .values(finish_order=_ORDERS.c.n)
)
_INSERT_TRANSITION = insert(transitions).values(
    execution_id=bindparam("b_execution"),
    from_phase=bindparam("b_from"),
    to_phase=bindparam("b_to"),
    version=bindparam("b_version"),
    at=bindparam("b_now", type_=transitions.c.at.type),
    worker=bindparam("b_owner"),
    duration_ms=bindparam("b_duration"),
    note=bindparam("b_note"),
)


@dataclass(frozen=True)
class _Write:
    """One commit_transition's write, as its steps share it."""

    claim: Claim
    transition: Transition
    owner: str
    now: datetime
    #: PostgreSQL, a move: the run's compare-and-set, its ``transitions`` row, the task's row and
    #: the calls' finishing order go in one statement (_move_statement)
    combined: bool
    #: _task_statement's shape (usage, status, running); None: the task's row is not written
    task_shape: tuple[bool, bool, bool] | None

    @property
    def call_key(self) -> dict[str, Any]:
        """The bind parameters naming the turn's calls (calls.CALL_KEY, less the call)."""
        return {"b_execution": self.claim.execution_id, "b_turn": self.claim.turn}


def commit_transition(
    conn: Connection,
    claim: Claim,
    transition: Transition,
    *,
    owner: str,
    now: datetime,
    duration_ms: float,
    error: JSON | None = None,
    next_lease_until: datetime | None = None,
    fresh: bool = False,
) -> Fresh | bool:
    """Write a tick's whole outcome in the caller's transaction (I1).

    ``next_lease_until``: a move that also claims its next step for ``owner`` (see
    :func:`claimed_next`), leased until then. ``fresh`` (PostgreSQL, with it): the move also
    reads what that step's claim statement would have read, returned as a :class:`Fresh`.

    Returns False, writing nothing, when the lease was lost meanwhile; the caller rolls back.
    """
    to = transition.to
    claim_next = next_lease_until is not None
    assert not claim_next or to is not None
    w = _Write(
        claim,
        transition,
        owner,
        now,
        combined=to is not None and conn.dialect.name == "postgresql",
        task_shape=_task_shape(transition),
    )
    statement = _run_statement(w, error=error is not None, claim_next=claim_next, fresh=fresh)
    params = _run_params(w, error, next_lease_until)
    if w.combined:
        params.update(_move_params(w, duration_ms))
    assert not fresh or (w.combined and claim_next)
    result = conn.execute(statement, params)
    row = result.first() if w.combined else None
    if (row is None) if w.combined else (result.rowcount != 1):
        return False

    _insert_items(conn, w)
    _deliver_messages(conn, w)
    _write_calls(conn, w)
    if not w.combined:
        _write_apart(conn, w, duration_ms)
    if fresh:
        assert row is not None
        return Fresh(
            row.inbox,
            row.model_calls,
            row.status,
            row.timeout_at,
            row.budget,
            claim.task_id,
            delegated=bool(row.delegated),
        )
    return True


def _task_shape(transition: Transition) -> tuple[bool, bool, bool] | None:
    """_task_statement's shape for what the transition writes to its task, if anything."""
    status = transition.task_status
    if status is None and not transition.usage:
        return None
    return (
        bool(transition.usage),
        status is not None,
        status in (TaskStatus.RUNNING, TaskStatus.WAITING),
    )


def _run_statement(w: _Write, *, error: bool, claim_next: bool, fresh: bool) -> Any:
    """The run's compare-and-set for the transition's shape: alone, or with what it carries."""
    t = w.transition
    usage = bool(t.model_calls or t.model_repeats)
    mail = bool(t.take_messages)
    if not w.combined:
        return _commit_statement(
            t.to is not None,
            t.state is not None,
            bool(t.items),
            t.next_turn,
            usage,
            error,
            mail,
            claim_next,
        )
    return _move_statement(
        t.state is not None,
        bool(t.items),
        t.next_turn,
        usage,
        error,
        mail,
        claim_next,
        w.task_shape,
        fresh,
        bool(t.finish_order),
    )


def _run_params(w: _Write, error: JSON | None, next_lease_until: datetime | None) -> dict[str, Any]:
    """_commit_statement's bind parameters (every shape's: a statement ignores those it lacks)."""
    t, to = w.transition, w.transition.to
    return {
        "b_id": w.claim.execution_id,
        "b_version": w.claim.version,
        "b_owner": w.owner,
        "b_wake_at": t.wake_at,
        "b_state": t.state,
        "b_to": to.value if to is not None else None,
        "b_now": w.now,
        "b_items": len(t.items),
        "b_model_calls": t.model_calls,
        "b_model_repeats": t.model_repeats,
        "b_error": error,
        "b_taken": len(t.take_messages),
        "b_next_owner": w.owner,
        "b_next_until": next_lease_until,
    }


def _task_params(w: _Write) -> dict[str, Any]:
    """_task_statement's bind parameters but ``b_now`` (in a combined statement, the run's)."""
    usage = w.transition.usage or {}
    status = w.transition.task_status
    return {
        "b_task": w.claim.task_id,
        "b_input": usage.get("input_tokens", 0),
        "b_output": usage.get("output_tokens", 0),
        "b_reasoning": usage.get("reasoning_tokens", 0),
        "b_cache_read": usage.get("cache_read_tokens", 0),
        "b_cache_write": usage.get("cache_write_tokens", 0),
        "b_status": status.value if status is not None else None,
    }


def _move_params(w: _Write, duration_ms: float) -> dict[str, Any]:
    """What _move_statement binds besides the run's compare-and-set: the task's row, the
    calls' finishing order and the ``transitions`` row."""
    t, to = w.transition, w.transition.to
    assert to is not None
    params = _task_params(w) if w.task_shape is not None else {}
    if t.finish_order:
        params.update(
            b_order_calls=list(t.finish_order),
            b_orders=list(t.finish_order.values()),
            b_order_turn=w.claim.turn,
        )
    params.update(
        b_from=w.claim.phase.value,
        b_to2=to.value,
        b_next_version=w.claim.version + 1,
        b_now2=w.now,
        b_owner2=w.owner,
        b_duration=duration_ms,
        b_note=t.note,
    )
    return params


def _insert_items(conn: Connection, w: _Write) -> None:
    if not w.transition.items:
        return
    conn.execute(
        _INSERT_ITEMS,
        [
            {
                "execution_id": w.claim.execution_id,
                "seq": w.claim.next_seq + n,
                "turn": w.claim.turn,
                "kind": item.kind.value,
                "call_id": item.call_id,
                "payload": item.payload,
                "created_at": w.now,
            }
            for n, item in enumerate(w.transition.items)
        ],
    )


def _deliver_messages(conn: Connection, w: _Write) -> None:
    taken = w.transition.take_messages
    if not taken:
        return
    claim = w.claim
    # Each message enters once (I22): a message already delivered matches nothing, and the
    # transaction rolls back rather than write its item twice.
    delivered = conn.execute(
        _DELIVER,
        [
            {"b_message": mid, "b_seq": claim.next_seq + n, "b_turn": claim.turn, "b_now": w.now}
            for mid, n in taken
        ],
    )
    if delivered.rowcount not in (-1, len(taken)):
        raise RuntimeError(f"run {claim.execution_id}: a message was taken in by another boundary")


def _write_calls(conn: Connection, w: _Write) -> None:
    """The turn's calls: the model's new ones inserted, then queued, then settled."""
    t, now = w.transition, w.now
    if t.calls:
        conn.execute(_INSERT_CALLS, call_rows(w.claim, t, now))
    key = w.call_key
    # One executemany per kind of change, whatever the fan-out: no statement per call.
    queued = t.queue_calls + t.ask_calls
    if queued:
        conn.execute(
            _QUEUE_CALLS,
            [
                {**key, "b_call": cid, "b_at": deadline, "b_now": now, "b_version": w.claim.version}
                for cid, deadline in queued
            ],
        )
    if t.settle:
        conn.execute(
            calls.SETTLE,
            [
                {
                    **key,
                    "b_call": s.call_id,
                    "b_outcome": s.outcome.value,
                    "b_result": s.result,
                    "b_now": now,
                    "b_owner": w.owner,
                    "b_duration": s.duration_ms,
                }
                for s in t.settle
            ],
        )


def _write_apart(conn: Connection, w: _Write, duration_ms: float) -> None:
    """What _move_statement writes with the compare-and-set, one statement each where it is not
    used (SQLite, or a wait): the calls' finishing order, the task's row, the transition's row."""
    t, to = w.transition, w.transition.to
    if t.finish_order:
        conn.execute(
            _FINISH_ORDER,
            [{**w.call_key, "b_call": cid, "b_order": n} for cid, n in t.finish_order.items()],
        )
    if w.task_shape is not None:
        conn.execute(_task_statement(*w.task_shape), {**_task_params(w), "b_now": w.now})
    if to is not None:
        conn.execute(
            _INSERT_TRANSITION,
            {
                "b_execution": w.claim.execution_id,
                "b_from": w.claim.phase.value,
                "b_to": to.value,
                "b_version": w.claim.version + 1,
                "b_now": w.now,
                "b_owner": w.owner,
                "b_duration": duration_ms,
                "b_note": t.note,
            },
        )


@dataclass(frozen=True)
class Fresh:
    """What a move that claims its next step (PostgreSQL) read of its run and task, as the
    next step's claim statement would have: the run's mailbox count and model calls after the
    move, and the task's mutable columns as the statement's snapshot has them."""

    inbox: int
    model_calls: int
    status: str | None
    timeout_at: datetime | None
    budget: JSON | None
    task_id: str
    #: the task's tokens (TOKEN_COLUMNS, in order), when the statement read them too (a fused
    #: commit): a budget that counts tokens needs no statement more
    tokens: tuple[int, ...] | None = None
    #: whether the task has started a child (see _DELEGATED)
    delegated: bool = False


def claimed_next(
    claim: Claim,
    transition: Transition,
    fresh: Fresh | None = None,
    conn: Connection | None = None,
) -> Claim:
    """The claim of the step after ``claim``, taken by its move (``commit_transition`` with
    ``next_lease_until``), as the claim statement would have returned it: what that move wrote,
    read back from the transition instead of the row. The transaction holds the run's row
    since its first statement, so nothing else has changed it. Its task is the task as the
    move left it (the claim that began the transaction read it): a stop committed meanwhile is
    seen at the next transaction's boundary, a model call's claim reads the task afresh."""
    assert transition.to is not None and claim.task is not None
    task = claim.task
    inbox = claim.inbox - len(transition.take_messages)
    if fresh is not None:
        # Read by the move itself: a stop or a message committed since this transaction's
        # claim (a model call ago, for call_model's move) is seen at the step's boundary (I18,
        # I22), as its own claim would have seen it.
        if fresh.status is None:
            raise RuntimeError(f"run {claim.execution_id}: its task row is gone")
        task = replace(task, status=TaskStatus(fresh.status), timeout_at=fresh.timeout_at)
        inbox = fresh.inbox
        if transition.to is Phase.CALL_MODEL and fresh.budget:
            task = replace(
                task,
                budget=fresh.budget,
                usage=_usage(conn, fresh),
                delegated=fresh.delegated,
            )
    status = transition.task_status
    if status is not None and task.status.value in ACTIVE:
        task = replace(task, status=status)
    return Claim(
        claim.execution_id,
        claim.task_id,
        transition.to,
        claim.version + 1,
        claim.turn + 1 if transition.next_turn else claim.turn,
        claim.next_seq + len(transition.items),
        transition.state if transition.state is not None else claim.state,
        1,
        None,
        task,
        inbox,
        claim.identity,
        claim.priority,
    )


def calls_as_left(
    claim: Claim,
    calls_before: list[CallView] | None,
    transition: Transition,
    *,
    now: datetime,
    owner: str,
    dialect: str,
) -> list[CallView] | None:
    """The turn's calls as ``commit_transition`` left them, read back from the transition
    instead of the table (a merged transaction's next step): the rows this
    transaction inserted (nobody else sees them yet) or locked (``calls_before``, loaded FOR
    UPDATE by this step's view), with its writes applied as its statements apply them.

    ``None`` when they cannot be known without reading: the step did not hold the turn's calls,
    or it moved to a new turn, or a value's stored form cannot be predicted (its JSON as the
    table returns it, transcripts.as_stored: a result renders into the model's prompt, which
    must not depend on whether it was read). ``calls_before`` is ``None`` for a phase that holds
    no calls; a model call's turn is new (each turn's calls are inserted by its one model
    call), so it starts from none."""

    def stored(value: Any) -> Any:
        ok, as_read = as_stored(value, dialect)
        if not ok:
            raise _Unpredictable
        return as_read

    try:
        return _calls_as_left(claim, calls_before, transition, now, owner, stored)
    except _Unpredictable:
        return None


class _Unpredictable(Exception):
    pass


def _calls_as_left(
    claim: Claim,
    calls_before: list[CallView] | None,
    transition: Transition,
    now: datetime,
    owner: str,
    stored: Any,
) -> list[CallView] | None:
    if transition.next_turn:
        return None
    if claim.phase is Phase.CALL_MODEL:
        rows: list[CallView] = []
    elif calls_before is None:
        return None
    else:
        rows = list(calls_before)
    for new in transition.calls:
        settled = new.settled
        rows.append(
            CallView(
                call_id=new.call_id,
                turn=claim.turn,
                index=new.index,
                name=new.name,
                arguments=stored(new.arguments),
                state=CallState.SETTLED if settled else CallState.PENDING,
                outcome=settled[0] if settled else None,
                result=stored(settled[1]) if settled else None,
                queued_at=None,
                started_at=None,
                settled_at=now if settled else None,
                deadline_at=None,
                attempts=0,
                hold=None if settled else new.hold,
                hold_info=None if settled else stored(new.hold_info),
                settled_by="validation" if settled else None,
            )
        )
    queued = dict(transition.queue_calls + transition.ask_calls)
    settles = {s.call_id: s for s in transition.settle}
    if not queued and not settles:
        return sorted(rows, key=lambda c: c.index)
    left = []
    for call in rows:
        deadline = queued.get(call.call_id)
        if deadline is not None and call.queued_at is None:  # as _QUEUE_CALLS
            call = replace(call, queued_at=now, deadline_at=deadline)
        done = settles.get(call.call_id)
        if done is not None and call.state is not CallState.SETTLED:  # as calls.SETTLE
            call = replace(
                call,
                state=CallState.SETTLED,
                outcome=done.outcome,
                result=stored(done.result),
                settled_at=now,
                settled_by=owner,
                lease_owner=None,
                hold=None,
            )
        left.append(call)
    return sorted(left, key=lambda c: c.index)


def call_rows(claim: Claim, transition: Transition, now: datetime) -> list[dict[str, Any]]:
    """The tool_calls rows of a model's new calls, as inserted (before any queue or start)."""
    rows = []
    for call in transition.calls:
        settled = call.settled
        rows.append(
            {
                "execution_id": claim.execution_id,
                "call_id": call.call_id,
                "turn": claim.turn,
                "idx": call.index,
                "name": call.name,
                "arguments": call.arguments,
                "effect": Effect(call.effect).value,
                "resumable": call.resumable,
                "state": CallState.SETTLED.value if settled else CallState.PENDING.value,
                "outcome": settled[0].value if settled else None,
                "result": settled[1] if settled else None,
                "settled_at": now if settled else None,
                "settled_by": "validation" if settled else None,
                "attempts": 0,
                "late_reports": 0,
                "hold": None if settled or call.hold is None else call.hold.value,
                "hold_info": None if settled else call.hold_info,
                "on_interrupt": None if call.on_interrupt == "report" else call.on_interrupt,
            }
        )
    return rows


def record_refused_tick(
    conn: Connection,
    execution_id: str,
    version: int,
    owner: str,
    error: JSON,
    *,
    claim_committed: bool,
    recheck_at: datetime,
) -> None:
    """A tick whose writes the database refused: keep the error as evidence and free the run
    for the sweep. If the claim was rolled back with the rest, count the attempt here, so the
    poison limit still bounds the retries. A claim that was committed cleared the run's
    wake-up (every claim does): the run gets one at ``recheck_at``, a stall period ahead, by
    which the sweeps' wake scan publishes its tick again (a run in await_tools is found by
    nothing else)."""
    e = executions.c
    stmt = update(executions).where(e.id == execution_id, e.version == version)
    if claim_committed:
        stmt = stmt.where(e.lease_owner == owner).values(
            error=error, lease_owner=None, lease_until=None, wake_at=recheck_at
        )
    else:
        stmt = stmt.where(e.lease_owner.is_(None)).values(error=error, attempts=e.attempts + 1)
    conn.execute(stmt)


def fail_poisoned_task(conn: Connection, task_id: str, error: JSON, now: datetime) -> None:
    """The task of a run ended as poison (too many attempts): failed, with why, if still
    active; in the transition's own transaction."""
    conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.status.in_(ACTIVE))
        .values(status=TaskStatus.FAILED.value, error=error, finished_at=now)
    )
