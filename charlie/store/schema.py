"""The tables, as typed SQLAlchemy 2.x models.

The hot path (ticks, tool invocations, sweeps) uses Core statements against ``Model.__table__``;
the ORM classes are here for their types, for Alembic and for readable ad-hoc queries.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite stores naive text; PostgreSQL timestamptz)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONDoc = JSON().with_variant(JSONB(), "postgresql")


#: The predicates of migration 0016's partial indexes, as the sweeps' scans say them
#: (scans.MOVING_RUN, scans.IN_FLIGHT_CALL): runs neither done nor waiting for their calls, and
#: calls open and held for no person.
MOVING_RUN_WHERE = "phase <> 'done' AND phase <> 'await_tools'"
IN_FLIGHT_CALL_WHERE = "state <> 'settled' AND hold IS NULL"
#: the partial indexes of migration 0018: the rows a scan looks for, not every row a turn
#: writes (a steady turn's updates are not HOT: each index takes an entry at each write)
STARTED_CALL_WHERE = "state = 'started'"
HANDLE_SET_WHERE = "handle IS NOT NULL"
DEADLINE_SETTLED_WHERE = "outcome = 'deadline_exceeded'"
WAKE_SET_WHERE = "wake_at IS NOT NULL"


def _partial(name: str, column: str, where: str) -> Index:
    return Index(name, column, postgresql_where=text(where), sqlite_where=text(where))


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONDoc}


class Task(Base):
    """The scheduler's record: owns the lifecycle (I18)."""

    __tablename__ = "tasks"
    __table_args__ = (
        # list_tasks: newest first, by status, by parent; (created_at, id) is the page keyset
        Index("ix_tasks_created", "created_at", "id"),
        Index("ix_tasks_status_created", "status", "created_at", "id"),
        Index("ix_tasks_parent_created", "parent_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    #: (found by ix_tasks_parent_created, whose first column it is)
    parent_id: Mapped[str | None] = mapped_column(String(128), ForeignKey("tasks.id"), default=None)
    parent_call_id: Mapped[str | None] = mapped_column(String(200), default=None)
    prompt: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(500))
    tools: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: tool names whose calls wait for an approve in this task (submit(approve=...), I23).
    approve: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONDoc, default=dict)
    #: (found by ix_tasks_status_created, whose first column it is)
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    error: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    timeout_at: Mapped[datetime | None] = mapped_column(index=True, default=None)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0)
    #: input tokens read from / written to a provider's prompt cache: part of input_tokens,
    #: counted on their own to be priced at their rates (charlie.pricing)
    cache_read_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: the task's limits: {"tokens": N, "usd": X, "model_calls": K} (any of them), checked at
    #: every turn boundary against the durable usage.
    budget: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: the task's trace context (W3C: traceparent, tracestate): every tick continues it.
    trace: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: submit(priority=...): higher goes first among model calls waiting for a provider's
    #: capacity (charlie/limits.py) and, where the broker has priorities, among its messages.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Execution(Base):
    """A run: one persisted state machine (I1). ``version`` guards every transition (I2)."""

    __tablename__ = "executions"
    __table_args__ = (
        Index("ix_executions_phase_lease", "phase", "lease_until"),
        # the wake scan's (migration 0018): a run in motion has no wake-up
        _partial("ix_executions_wake_set", "wake_at", WAKE_SET_WHERE),
        # the live runs the sweeps scan (migration 0015; the literal is scans.LIVE_RUN's)
        _partial("ix_executions_live_updated", "updated_at", "phase <> 'done'"),
        # the runs in motion the stalled scan reads (migration 0016; scans.MOVING_RUN)
        _partial("ix_executions_moving_updated", "updated_at", MOVING_RUN_WHERE),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(128), ForeignKey("tasks.id"), unique=True)
    phase: Mapped[str] = mapped_column(String(32))
    version: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[dict[str, Any]] = mapped_column(JSONDoc, default=dict)
    turn: Mapped[int] = mapped_column(Integer, default=0)
    next_seq: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    #: when the row last moved; the stalled-run sweep compares against it (I4).
    updated_at: Mapped[datetime]
    #: when a sweep last re-published this row; throttles sweeps so two beats do not double-act.
    swept_at: Mapped[datetime | None] = mapped_column(default=None)
    wake_at: Mapped[datetime | None] = mapped_column(default=None)
    #: claims of the current (phase, version) that did not commit: the poison-message counter.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    model_calls: Mapped[int] = mapped_column(Integer, default=0)
    model_repeats: Mapped[int] = mapped_column(Integer, default=0)
    #: messages sent and not yet taken in at a turn boundary: read by every claim for free, so
    #: a boundary looks in the mailbox only when there is mail (I22).
    inbox: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime]


class TranscriptItem(Base):
    """I6: one chronology, dense ``seq`` per execution."""

    __tablename__ = "transcript_items"
    __table_args__ = (UniqueConstraint("execution_id", "seq", name="uq_transcript_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    execution_id: Mapped[str] = mapped_column(String(128), ForeignKey("executions.id"))
    seq: Mapped[int] = mapped_column(Integer)
    turn: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    call_id: Mapped[str | None] = mapped_column(String(200), default=None)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    created_at: Mapped[datetime]


class ToolCall(Base):
    """The pending-tool record: intent, dispatch state and the one authoritative outcome."""

    __tablename__ = "tool_calls"
    __table_args__ = (
        UniqueConstraint("execution_id", "turn", "call_id", name="uq_tool_call"),
        # the orphan scan's started calls, the waits on a task, and the waits the late watch
        # observes (migration 0018; scans.STARTED_CALL, calls.OVERDUE_WAIT)
        _partial("ix_tool_calls_started_lease", "lease_until", STARTED_CALL_WHERE),
        _partial("ix_tool_calls_handle_set", "handle", HANDLE_SET_WHERE),
        _partial("ix_tool_calls_deadline_settled", "settled_at", DEADLINE_SETTLED_WHERE),
        # the open calls the sweeps scan (migration 0015; the literal is scans.OPEN_CALL's)
        _partial("ix_tool_calls_open_deadline", "deadline_at", "state <> 'settled'"),
        # the calls in flight the lost and abandoned scans read (migration 0016;
        # scans.IN_FLIGHT_CALL)
        _partial("ix_tool_calls_in_flight", "queued_at", IN_FLIGHT_CALL_WHERE),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    execution_id: Mapped[str] = mapped_column(String(128), ForeignKey("executions.id"))
    call_id: Mapped[str] = mapped_column(String(200))
    turn: Mapped[int] = mapped_column(Integer)
    idx: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(200))
    arguments: Mapped[dict[str, Any]] = mapped_column(JSONDoc)
    effect: Mapped[str] = mapped_column(String(8))
    resumable: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[str] = mapped_column(String(10))
    queued_at: Mapped[datetime | None] = mapped_column(default=None)
    #: the execution version of the tick that queued this call (I14 evidence).
    dispatch_version: Mapped[int | None] = mapped_column(Integer, default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    started_by: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_owner: Mapped[str | None] = mapped_column(String(200), default=None)
    lease_until: Mapped[datetime | None] = mapped_column(default=None)
    #: how many times a worker claimed this call (first start, resumes, reconciles).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    deadline_at: Mapped[datetime | None] = mapped_column(default=None)
    outcome: Mapped[str | None] = mapped_column(String(20), default=None)
    result: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    settled_at: Mapped[datetime | None] = mapped_column(default=None)
    settled_by: Mapped[str | None] = mapped_column(String(200), default=None)
    finish_order: Mapped[int | None] = mapped_column(Integer, default=None)
    #: a handle on work outside Charlie: a command's execution id, a child task id.
    handle: Mapped[str | None] = mapped_column(String(200), default=None)
    late_reports: Mapped[int] = mapped_column(Integer, default=0)
    late_result: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    swept_at: Mapped[datetime | None] = mapped_column(default=None)
    duration_ms: Mapped[float | None] = mapped_column(Float, default=None)
    #: which code the call was started with (a ToolDef's ``implementation``), written by the
    #: claim that marks it started; a resume or reconcile runs only that code.
    implementation: Mapped[str | None] = mapped_column(String(300), default=None)
    #: what a person must do before this open call can settle (domain.Hold), else NULL: an
    #: approval, a reply, a reconcile verdict (I23, I25).
    hold: Mapped[str | None] = mapped_column(String(16), default=None)
    #: why it is held: the question, what asked for approval, the interruption's evidence.
    hold_info: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: "hold": an interrupted call no reconcile hook settled waits for an operator.
    on_interrupt: Mapped[str | None] = mapped_column(String(8), default=None)


class Message(Base):
    """The mailbox: a person's message to a task, taken in at a turn boundary once (I22)."""

    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("task_id", "message_id", name="uq_message_id"),
        Index("ix_messages_pending", "task_id", "delivered_seq", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(128), ForeignKey("tasks.id"))
    message_id: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)
    sent_at: Mapped[datetime]
    sent_by: Mapped[str] = mapped_column(String(200))
    #: the transcript item it became (NULL: not taken in yet), at which turn, when.
    delivered_seq: Mapped[int | None] = mapped_column(Integer, default=None)
    delivered_turn: Mapped[int | None] = mapped_column(Integer, default=None)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)


class OperatorAction(Base):
    """I27: every send, reply, approve, deny, reconcile, resume, fork and cancel."""

    __tablename__ = "operator_actions"
    __table_args__ = (
        Index("ix_operator_actions_task", "task_id", "id"),
        Index("ix_operator_actions_call", "task_id", "call_id", "turn"),
        UniqueConstraint("request_id", name="uq_operator_action_request"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(128), ForeignKey("tasks.id"))
    action: Mapped[str] = mapped_column(String(16))
    call_id: Mapped[str | None] = mapped_column(String(200), default=None)
    turn: Mapped[int | None] = mapped_column(Integer, default=None)
    actor: Mapped[str] = mapped_column(String(200))
    at: Mapped[datetime]
    note: Mapped[str | None] = mapped_column(Text, default=None)
    detail: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: the caller's idempotency key (a Celery message id): the same request acts once.
    request_id: Mapped[str | None] = mapped_column(String(200), default=None)
    #: how the action arrived (domain.Channel: api, cli, ui, celery); NULL: recorded before
    #: channels were (I32).
    channel: Mapped[str | None] = mapped_column(String(16), default=None)
    #: whether ``actor`` was established by the channel (the console's token) rather than only
    #: claimed by the caller (I32).
    authenticated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class TransitionRecord(Base):
    """I21: every transition is evidence."""

    __tablename__ = "transitions"
    __table_args__ = (Index("ix_transitions_execution", "execution_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    execution_id: Mapped[str] = mapped_column(String(128), ForeignKey("executions.id"))
    from_phase: Mapped[str] = mapped_column(String(32))
    to_phase: Mapped[str] = mapped_column(String(32))
    version: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime]
    worker: Mapped[str] = mapped_column(String(200))
    duration_ms: Mapped[float] = mapped_column(Float)
    note: Mapped[str | None] = mapped_column(Text, default=None)


class Heartbeat(Base):
    """The last time a piece of the deployment did its periodic work (the sweeps), so that
    `charlie doctor` can tell from the database alone whether a beat is driving recovery."""

    __tablename__ = "heartbeats"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[datetime]
    worker: Mapped[str] = mapped_column(String(200))
    #: what the beating process reports of itself (a worker: the queues it consumes).
    detail: Mapped[str | None] = mapped_column(Text, default=None)


class SchemaFloor(Base):
    """The oldest code revision that can still run on this schema (one row, or none: every
    migration so far only added, so older code keeps working). A migration that removes or
    changes what older code uses (a contract step) raises it; a worker whose code does not
    know the floor's revision stops claiming work (charlie.store.revisions)."""

    __tablename__ = "schema_floor"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    revision: Mapped[str] = mapped_column(String(32))


class LimitState(Base):
    """One provider limit the fleet keeps (a CHARLIE_MODEL_LIMITS key): the row every caller
    of the limit locks while it counts, and the pause the provider asked for (I30)."""

    __tablename__ = "limit_state"

    limit_key: Mapped[str] = mapped_column(String(500), primary_key=True)
    #: a 429 / 529 with retry-after: no caller of the limit sends before this
    paused_until: Mapped[datetime | None] = mapped_column(default=None)
    throttles: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class LimitSlot(Base):
    """A request sent under a limit: in flight while ``released_at`` is NULL and the run's
    lease that took it (execution, version, attempt) is live, so a dead holder's slot lapses
    with its lease and a run claimed again never counts its old slot (I30); kept a minute after
    for rpm and tpm."""

    __tablename__ = "limit_slots"
    __table_args__ = (
        Index("ix_limit_slots_key_taken", "limit_key", "taken_at"),
        Index("ix_limit_slots_execution", "execution_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    limit_key: Mapped[str] = mapped_column(String(500))
    execution_id: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    taken_at: Mapped[datetime]
    released_at: Mapped[datetime | None] = mapped_column(default=None)
    #: estimated before the call, the reported usage after it
    tokens: Mapped[int] = mapped_column(Integer, default=0)


class LimitWaiter(Base):
    """A run whose model call waits for capacity: it holds no lease and no worker (I30); the
    order callers go in (priority, then since), and until when it holds its place."""

    __tablename__ = "limit_waiters"
    __table_args__ = (Index("ix_limit_waiters_order", "limit_key", "priority", "since"),)

    limit_key: Mapped[str] = mapped_column(String(500), primary_key=True)
    execution_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    since: Mapped[datetime]
    #: a waiter that has not asked again by then (its run stopped, its wake-up was lost)
    #: holds no one back
    expires_at: Mapped[datetime]
    #: when a release woke it (published its tick): the next release wakes the one after it
    woken_at: Mapped[datetime | None] = mapped_column(default=None)


class LimitAction(Base):
    """An operator's action on a provider limit (I27, I32): a pause lifted (``resume``), with
    who, when, how it arrived and what it changed."""

    __tablename__ = "limit_actions"
    __table_args__ = (Index("ix_limit_actions_key", "limit_key", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    limit_key: Mapped[str] = mapped_column(String(500))
    action: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(200))
    at: Mapped[datetime]
    note: Mapped[str | None] = mapped_column(Text, default=None)
    detail: Mapped[Any | None] = mapped_column(JSONDoc, default=None)
    #: how it arrived (domain.Channel) and whether the channel established ``actor`` (I32)
    channel: Mapped[str] = mapped_column(String(16))
    authenticated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


# The Core tables the hot path uses (the ORM classes above are their typed description).
tasks = cast(Table, Task.__table__)
executions = cast(Table, Execution.__table__)
transcript_items = cast(Table, TranscriptItem.__table__)
tool_calls = cast(Table, ToolCall.__table__)
transitions = cast(Table, TransitionRecord.__table__)
heartbeats = cast(Table, Heartbeat.__table__)
messages = cast(Table, Message.__table__)
operator_actions = cast(Table, OperatorAction.__table__)
schema_floor = cast(Table, SchemaFloor.__table__)
limit_state = cast(Table, LimitState.__table__)
limit_slots = cast(Table, LimitSlot.__table__)
limit_waiters = cast(Table, LimitWaiter.__table__)
limit_actions = cast(Table, LimitAction.__table__)
