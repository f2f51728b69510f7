"""The Python API producers use: submit, get_task, wait, cancel, transcript."""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from charlie import people, pricing, scheduler
from charlie.config import WorkspaceRefused, settings
from charlie.domain import (
    JSON,
    MAX_TASK_ID,
    TASK_ID,
    Action,
    Channel,
    Origin,
    Phase,
    TaskSpend,
    TaskStatus,
    execution_id_for,
    task_id_of,
)
from charlie.models import normalise_model, retrying
from charlie.models.retrying import Retrying
from charlie.people import (
    ActionRecord,
    ActionRefused,
    CallNotFound,
    ForkRefused,
    MessageConflict,
    NotHeld,
    NotResumable,
    TaskFinished,
    VerdictConflict,
    action_for_request,
    actions,
    approve,
    deny,
    fork,
    reconcile,
    reply,
    resume,
    send,
)
from charlie.runtime import Producer, get_producer, import_tool_modules
from charlie.scheduler import TaskConflict, TaskNotFound
from charlie.store import people as people_store
from charlie.store import reads, spend
from charlie.store.engine import again_if_disconnected, read, retried_if_disconnected
from charlie.store.types import Connection
from charlie.streams.base import StreamEvent, StreamUnavailable
from charlie.tools.registry import REGISTRY

log = logging.getLogger("charlie.api")

MAX_METADATA_BYTES = 64 * 1024


class InvalidSubmission(ValueError):
    """The submission was refused before anything was written."""


class PayloadTooLarge(InvalidSubmission):
    pass


class UnknownToolError(InvalidSubmission):
    pass


@dataclass(frozen=True)
class WaitingFor:
    """An open call that waits for a person, and for what."""

    #: "approval", "reply" or "reconcile" (domain.Hold)
    kind: str
    call_id: str
    turn: int
    tool: str
    arguments: JSON
    #: the question, why approval is needed, or the interruption's evidence
    detail: JSON
    deadline_at: datetime | None

    def describe(self) -> str:
        if self.kind == "reply":
            return f"a reply to {self.call_id}: {self.detail.get('question')}"
        if self.kind == "approval":
            return f"an approval of {self.call_id} ({self.tool})"
        return f"a reconcile verdict on {self.call_id} ({self.tool}, interrupted)"


_COUNTED = (
    "input_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "model_calls",
)


@dataclass(frozen=True)
class TaskInfo:
    id: str
    status: TaskStatus
    result: Any
    error: Any
    parent_id: str | None
    model: str
    prompt: str
    metadata: JSON
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    phase: Phase | None
    turn: int
    model_calls: int
    model_repeats: int
    usage: dict[str, int]
    #: what a waiting task waits for from a person: questions, approvals, held calls (I25).
    waiting_for: list[WaitingFor] = field(default_factory=list)
    #: a model call held back by a provider limit (CHARLIE_MODEL_LIMITS, I30), as its last
    #: look at the limit saw it: "waiting for capacity on openai:gpt-4.1 (2 in flight, 14
    #: waiting)"; None when it is not waiting for capacity
    capacity: str | None = None
    #: its model call failing and being retried (I36): the last error, the failed attempts,
    #: the next attempt's time and when the retrying gives up (``describe()`` says it in a
    #: line); None when its model call is not being retried
    retrying: Retrying | None = None
    #: the task's budget as stored at submit (``{"tokens": N, "usd": X, "model_calls": K}``,
    #: any of them), or None.
    budget: JSON | None = None
    #: what its tokens cost in USD by CHARLIE_PRICES; None when its model has no price.
    cost_usd: float | None = None
    #: what the tasks it delegated (its children and theirs) have spent, which its budget
    #: counts too: input/output/reasoning tokens, model_calls, cost_usd (None: a model among
    #: them has no price). None when it delegated nothing; get_task reads it, list_tasks not.
    delegated_usage: JSON | None = None

    def budget_used(self) -> list[tuple[str, Any, Any]]:
        """(limit's key, used, limit) for each limit of the budget: its own spend and, when
        read (get_task), its delegated tasks'."""
        usage = {**self.usage, "model_calls": self.model_calls}
        cost = self.cost_usd
        below = self.delegated_usage
        if below:
            usage = {k: int(usage.get(k) or 0) + int(below.get(k) or 0) for k in _COUNTED}
            below_cost = below.get("cost_usd")
            cost = None if cost is None or below_cost is None else cost + below_cost
        return [
            (key, cost if key == "usd" else used, limit)
            for key, used, limit in pricing.describe(self.budget, usage, self.model, {})
        ]

    @property
    def terminal(self) -> bool:
        return self.status.terminal


@dataclass(frozen=True)
class TranscriptEntry:
    seq: int
    turn: int
    kind: str
    call_id: str | None
    payload: JSON
    outcome: str | None


@dataclass(frozen=True)
class CallRecord:
    call_id: str
    turn: int
    index: int
    name: str
    arguments: JSON
    effect: str
    state: str
    outcome: str | None
    result: Any
    queued_at: datetime | None
    dispatch_version: int | None
    started_at: datetime | None
    started_by: str | None
    settled_at: datetime | None
    settled_by: str | None
    finish_order: int | None
    duration_ms: float | None
    attempts: int
    handle: str | None
    late_reports: int
    #: the latest late report, ``{"outcome": ..., "result": ...}`` (I12, I13); for a wait,
    #: the end of its outside work, recorded once.
    late_result: Any = None
    #: when the call's deadline settles it ``deadline_exceeded`` (None: not queued yet, or held)
    deadline_at: datetime | None = None
    #: who holds the call now and until when (a started call's lease, I5, I12)
    lease_owner: str | None = None
    lease_until: datetime | None = None
    #: what a person must do before it can settle (``approval``, ``reply``, ``reconcile``) and
    #: why: the question, what asked for approval, the interruption's evidence (I23, I25)
    hold: str | None = None
    hold_info: Any = None
    resumable: bool = False


__all__ = [
    "ActionRecord",
    "ActionRefused",
    "CallNotFound",
    "CallRecord",
    "Channel",
    "ForkRefused",
    "InvalidSubmission",
    "MessageConflict",
    "NotHeld",
    "NotResumable",
    "Origin",
    "PayloadTooLarge",
    "StreamEvent",
    "StreamUnavailable",
    "TaskConflict",
    "TaskFinished",
    "TaskInfo",
    "TaskNotFound",
    "TranscriptEntry",
    "UnknownToolError",
    "VerdictConflict",
    "WaitingFor",
    "action_for_request",
    "actions",
    "approve",
    "calls",
    "cancel",
    "deny",
    "events",
    "fork",
    "get_task",
    "history",
    "list_tasks",
    "normalise_model",
    "reconcile",
    "reply",
    "resume",
    "revision",
    "run_record",
    "send",
    "submit",
    "transcript",
    "wait",
]


def unknown_tools(names: list[str], modules: tuple[str, ...]) -> list[str]:
    """The names no tool is registered under, in this process, for a submit to refuse.

    A producer (a web app) knows the built-ins and the tools it declared itself without
    importing anything of the worker's. Only a name it does not know sends it to the worker's
    tool modules (CHARLIE_TOOL_MODULES), imported then, or for an ``mcp__SERVER__TOOL`` name to
    the configured MCP servers, whose tools are listed then (sessions closed after), so a typo
    is still refused before anything is written while a submit naming known tools imports none
    of them and starts no MCP server."""
    unknown = [t for t in names if REGISTRY.get(t) is None]
    if unknown and modules:
        import_tool_modules(modules)
        unknown = [t for t in unknown if REGISTRY.get(t) is None]
    if any(t.startswith("mcp__") for t in unknown):
        s = settings()
        if s.mcp_config or s.mcp_servers:
            from charlie import mcp

            mcp.discover(s, REGISTRY)
            unknown = [t for t in unknown if REGISTRY.get(t) is None]
    return unknown


def submit(
    prompt: str,
    *,
    model: str | None = None,
    tools: list[str] | None = None,
    task_id: str | None = None,
    timeout: float | None = None,
    metadata: JSON | None = None,
    approve: list[str] | None = None,
    budget: JSON | None = None,
    priority: int = 0,
    agent: str | None = None,
    deps: str | None = None,
    usage_limits: Any = None,
) -> str:
    """Submit an agent task and return its id. Idempotent on ``task_id``: submitting the same
    id again returns it without starting a second run. ``approve``: tool names whose calls in
    this task wait for a person's approve (or deny) before they are dispatched (I23).
    ``budget``: ``{"tokens": N, "usd": X, "model_calls": K}``, any of them, over the defaults
    of CHARLIE_BUDGET_* (a limit given as None drops its default); stored on the task, checked
    before every model call: the task fails rather than call its model past it.
    ``priority``: a whole number, higher first, that orders this task's model calls among those
    waiting for a provider limit's capacity (CHARLIE_MODEL_LIMITS); 0 by default.
    ``agent``: ``"module:attr"`` of a Pydantic AI agent to run instead of a ``model`` (its
    model, tools and output are the task's; docs/agents/pydantic-ai.md), importable here and
    on the workers; ``deps``: ``"module:function"`` that builds its deps on the worker. What
    of the agent cannot be made durable is refused here, by name (InvalidSubmission).
    ``usage_limits``: Pydantic AI's ``UsageLimits`` (or a dict of its fields) for an agent
    task, enforced as ``agent.run`` enforces them, from the task's transcript."""
    rt = get_producer()
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidSubmission(f"priority must be a whole number, got {priority!r}")
    if not -1000 <= priority <= 1000:
        raise InvalidSubmission(f"priority must be between -1000 and 1000, got {priority}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidSubmission("prompt must be a non-empty string")
    size = len(prompt.encode())
    if size > rt.settings.max_prompt_bytes:
        raise PayloadTooLarge(
            f"prompt is {size} bytes; the limit is {rt.settings.max_prompt_bytes} "
            "(CHARLIE_MAX_PROMPT_BYTES)"
        )
    if agent is not None:
        if model is not None or tools is not None:
            raise InvalidSubmission(
                "an agent task takes its model and tools from its agent: give agent= without "
                "model= or tools="
            )
        from charlie.agents import AgentRefused, prepare_submission

        try:
            made = prepare_submission(agent, deps, approve, metadata, usage_limits)
        except AgentRefused as exc:
            raise InvalidSubmission(str(exc)) from None
        model, tools, metadata = made.model, made.tools, made.metadata
        approve = None if made.approve is None else list(made.approve)
    elif deps is not None:
        raise InvalidSubmission("deps= is for an agent task (agent=)")
    elif usage_limits is not None:
        raise InvalidSubmission("usage_limits= is for an agent task (agent=); see budget=")
    elif model is None:
        raise InvalidSubmission("give model= (a model spec) or agent= (module:attr)")
    else:
        model = normalise_model(model)
    if tools is not None:
        if isinstance(tools, str) or not all(isinstance(t, str) for t in tools):
            raise InvalidSubmission("tools must be a list of tool names")
        unknown = unknown_tools(tools, rt.settings.tool_modules)
        if unknown:
            raise UnknownToolError(
                f"unknown tool(s) {', '.join(unknown)}; registered: {', '.join(REGISTRY.names())}"
                " (user tools register through CHARLIE_TOOL_MODULES, MCP servers' tools through "
                "CHARLIE_MCP_CONFIG or CHARLIE_MCP_SERVERS: `charlie tools` lists them)"
            )
    if approve is not None:
        if isinstance(approve, str) or not all(isinstance(t, str) for t in approve):
            raise InvalidSubmission("approve must be a list of tool names")
        unknown = unknown_tools(list(approve), rt.settings.tool_modules)
        if unknown:
            raise UnknownToolError(
                f"approve names unknown tool(s) {', '.join(unknown)}; registered: "
                f"{', '.join(REGISTRY.names())}"
            )
        approve = sorted(set(approve))
    if task_id is not None and not TASK_ID.match(task_id):
        raise InvalidSubmission(
            f"task id {task_id!r} must be 1-{MAX_TASK_ID} characters of letters, digits and ._:-"
        )
    if timeout is not None and timeout <= 0:
        raise InvalidSubmission(f"timeout must be positive seconds, got {timeout}")
    if metadata is not None:
        try:
            encoded = json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise InvalidSubmission(f"metadata must be JSON-serialisable: {exc}") from exc
        if not isinstance(metadata, dict):
            raise InvalidSubmission("metadata must be a JSON object")
        if len(encoded) > MAX_METADATA_BYTES:
            raise PayloadTooLarge(f"metadata is {len(encoded)} bytes; the limit is 64 KiB")
        if metadata.get("workspace") is not None:
            # The worker confines it again before any tool runs.
            try:
                rt.settings.confine_workspace(metadata["workspace"])
            except WorkspaceRefused as exc:
                raise InvalidSubmission(str(exc)) from None
    try:
        budget = pricing.with_defaults(budget, rt.settings.budget_defaults)
        if budget and "usd" in budget:
            pricing.check_priced(budget, model, pricing.price_table(rt.settings.prices))
    except (pricing.BudgetError, pricing.PriceError) as exc:
        raise InvalidSubmission(str(exc)) from None
    # The id is fixed before the first try, so a try again after a lost connection finds the
    # task the first one may have committed instead of saving a second.
    task_id = task_id or uuid.uuid4().hex
    tries = 0

    def save() -> scheduler.Submitted:
        nonlocal tries
        tries += 1
        return scheduler.submit(
            rt.engine,
            prompt=prompt,
            model=model,
            tools=tools,
            task_id=task_id,
            timeout=timeout,
            metadata=metadata,
            approve=approve,
            budget=budget,
            priority=priority,
        )

    submitted = again_if_disconnected(save, "submit a task")
    # After a try again, "already there" may be this call's own first try: publish the first
    # tick anyway (a duplicate is a stale tick, a no-op; I3).
    first = submitted.created or tries > 1
    if first and not rt.publisher.tick(
        submitted.execution_id, Phase.LOAD_CONTEXT, 0, priority=priority
    ):
        log.warning(
            "task %s is saved but its first tick could not be published (broker down?); "
            "beat's sweep will start it",
            submitted.task_id,
        )
    return submitted.task_id


@retried_if_disconnected
def worker_pools() -> list[tuple[str, dict[str, Any]]]:
    """(node, its pool report) of each live worker: its pool, concurrency, and the model calls
    (a prefork worker: the tasks) in flight at its last heartbeat and at most since the one
    before (charlie.presence; `charlie doctor` and the console show them)."""
    from charlie.domain import utcnow
    from charlie.presence import live_pools
    from charlie.store.heartbeats import load_heartbeats

    rt = get_producer()
    with read(rt.engine) as conn:
        beats = load_heartbeats(conn)
    return live_pools(beats, utcnow())


@retried_if_disconnected
def get_task(task_id: str) -> TaskInfo:
    with read(get_producer().engine) as conn:
        row = reads.task_with_run(conn, task_id)
        if row is None:
            raise TaskNotFound(task_id)
        waits = _waiting_for(conn, [row])
        below = [t for t in spend.subtree_spend(conn, task_id) if t.task_id != task_id]
    info = _task_info(row, waits.get(row.id, []))
    return replace(info, delegated_usage=_delegated_usage(below)) if below else info


def _delegated_usage(below: list[TaskSpend]) -> JSON:
    """What a task's delegated tasks spent, summed, each priced by its own model."""
    try:
        prices = pricing.price_table(get_producer().settings.prices)
    except pricing.PriceError:
        prices = pricing.BUILTIN_PRICES
    used = pricing.spent([(t.model, t.usage) for t in below], prices)
    return {**{k: used[k] for k in _COUNTED}, "cost_usd": used["usd"], "tasks": len(below)}


#: the most tasks one list_tasks page returns.
MAX_PAGE = 1000


@retried_if_disconnected
def list_tasks(
    status: str | TaskStatus | Iterable[str | TaskStatus] | None = None,
    parent: str | None = None,
    limit: int = 50,
    before: str | None = None,
    search: str | None = None,
) -> list[TaskInfo]:
    """Tasks, newest first: at most ``limit`` (1-1000), only those with ``status`` (one or
    several), only the children of ``parent``, only those whose id or prompt contains
    ``search`` (case-insensitive). ``before`` is a task id: the page after the one that ended
    with it (``before=page[-1].id``). Every page costs the same on any number of tasks (an
    index per filter, keyset paging); a search reads tasks newest first until the page is
    full, so a rare word costs a walk of the (filtered) table."""
    statuses = _statuses(status)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_PAGE}, got {limit!r}")
    if search is not None and not isinstance(search, str):
        raise ValueError(f"search must be a string, got {search!r}")
    search = (search or "").strip()[:200] or None
    with read(get_producer().engine) as conn:
        keyset = None
        if before is not None:
            created = reads.task_created_at(conn, before)
            if created is None:
                raise TaskNotFound(before)
            keyset = (created, before)
        rows = reads.task_page(
            conn, statuses=statuses, parent=parent, limit=limit, before=keyset, search=search
        )
        waits = _waiting_for(conn, rows)
    return [_task_info(row, waits.get(row.id, [])) for row in rows]


def _waiting_for(conn: Connection, rows: list[Any]) -> dict[str, list[WaitingFor]]:
    """What the waiting tasks among ``rows`` wait for from a person: one query for a page."""
    waiting = [execution_id_for(r.id) for r in rows if r.status == TaskStatus.WAITING.value]
    found: dict[str, list[WaitingFor]] = {}
    for call in people_store.held_calls(conn, waiting):
        found.setdefault(task_id_of(call.execution_id), []).append(
            WaitingFor(
                kind=call.hold,
                call_id=call.call_id,
                turn=call.turn,
                tool=call.name,
                arguments=call.arguments,
                # (without what a tool keeps to go on once answered: not for people)
                detail={k: v for k, v in (call.hold_info or {}).items() if k != "asked"},
                deadline_at=call.deadline_at,
            )
        )
    return found


def _statuses(status: str | TaskStatus | Iterable[str | TaskStatus] | None) -> list[str] | None:
    if status is None:
        return None
    wanted = [status] if isinstance(status, str | TaskStatus) else list(status)
    known = {s.value for s in TaskStatus}
    values = [s.value if isinstance(s, TaskStatus) else str(s) for s in wanted]
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(
            f"unknown status {', '.join(map(repr, unknown))}; one of {', '.join(sorted(known))}"
        )
    return values


def _task_info(row: Any, waiting_for: list[WaitingFor] | None = None) -> TaskInfo:
    return TaskInfo(
        id=row.id,
        status=TaskStatus(row.status),
        result=row.result,
        error=row.error,
        parent_id=row.parent_id,
        model=row.model,
        prompt=row.prompt,
        metadata=row.metadata or {},
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        phase=Phase(row.x_phase) if row.x_phase else None,
        turn=row.x_turn or 0,
        model_calls=row.x_model_calls or 0,
        model_repeats=row.x_model_repeats or 0,
        usage={
            "input_tokens": row.input_tokens,
            "output_tokens": row.output_tokens,
            "reasoning_tokens": row.reasoning_tokens,
            "cache_read_tokens": row.cache_read_tokens,
            "cache_write_tokens": row.cache_write_tokens,
        },
        waiting_for=waiting_for or [],
        capacity=_capacity(row),
        retrying=_retrying(row),
        budget=row.budget,
        cost_usd=_cost(row),
    )


def _capacity(row: Any) -> str | None:
    """What a run waiting for a provider limit's capacity waits for: its model call, at
    call_model with no lease (a run that holds one has its slot, or is looking)."""
    state = getattr(row, "x_state", None) or {}
    waiting = state.get("capacity") if isinstance(state, dict) else None
    if not isinstance(waiting, dict) or row.x_phase != Phase.CALL_MODEL.value:
        return None
    if getattr(row, "x_lease_owner", None) is not None:
        return None
    return (
        f"waiting for capacity on {waiting.get('limit')} ({waiting.get('in_flight')} in "
        f"flight, {waiting.get('waiting')} waiting)"
    )


def _retrying(row: Any) -> Retrying | None:
    """A model call being retried, while the run is still at call_model and not ended."""
    if row.x_phase != Phase.CALL_MODEL.value or TaskStatus(row.status).terminal:
        return None
    return retrying.from_state(getattr(row, "x_state", None))


def _cost(row: Any) -> float | None:
    try:
        prices = pricing.price_table(get_producer().settings.prices)
    except pricing.PriceError:
        log.warning("CHARLIE_PRICES cannot be read; costs are not shown", exc_info=True)
        return None
    return pricing.cost_usd(
        row.model,
        row.input_tokens,
        row.output_tokens,
        row.reasoning_tokens,
        prices,
        cache_read_tokens=row.cache_read_tokens,
        cache_write_tokens=row.cache_write_tokens,
    )


def wait(task_id: str, timeout: float = 300.0, poll: float = 0.1) -> TaskInfo:
    """Block until the task is terminal; raises TimeoutError with its last status."""
    deadline = time.monotonic() + timeout
    while True:
        info = get_task(task_id)
        if info.terminal:
            return info
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"task {task_id} still {info.status.value} (phase {info.phase}) after {timeout} s"
            )
        time.sleep(poll)
        poll = min(poll * 1.5, 1.0)


#: how long a follower waits on the stream before it looks at the task itself
EVENTS_BLOCK = 1.0
#: once the record says the task ended, how long a reader still waits for its last events: a
#: worker's writer sends what it gathered every LINGER_SECONDS (50 ms), after the commit that
#: ended the task, so its final answer and end may reach the stream a moment after the record
ENDED_GRACE = 0.25


def events(
    task_id: str,
    after: str | None = None,
    *,
    follow: bool = True,
    timeout: float | None = None,
) -> Iterator[StreamEvent]:
    """A task's run as it happens, for people watching: each :class:`StreamEvent` has a
    ``type`` (charlie/streams/base.py lists them: ``model_start``, ``text``, ``reasoning``,
    ``tool_args``, ``model_end``, ``tool_call``, ``tool_settled``, ``waiting``, ``final``,
    ``end``...), its fields in ``data``, and the ``offset`` to resume after it: ``after=None``
    starts from the first event still kept, ``after=event.offset`` gets only what followed.

    ``follow``: wait for more until the task ends (the last event is ``end``, with the task's
    ``status``); else stop at what is there now. ``timeout``: stop following after this many
    seconds. Each event has an ``id``; one delivered again is dropped here (the same fact told
    twice, like a call's ``tool_settled``, carries the same id). A watcher's view, never the
    record (I28): a delta may be lost or repeated (a
    ``model_restart``, a ``model_end`` with ``status="abandoned"`` voids what its call streamed);
    the answer is the task's result. Raises TaskNotFound, or StreamUnavailable when streaming
    is off (CHARLIE_STREAMING=0) or the broker cannot carry it (RabbitMQ: set
    CHARLIE_STREAM_URL=redis://...)."""
    rt = get_producer()
    get_task(task_id)  # TaskNotFound before anything else
    transport = rt.streams
    if transport is None:
        raise StreamUnavailable(_why_no_stream(rt))
    deadline = None if timeout is None else time.monotonic() + timeout
    offset = after
    seen = _SeenIds()
    while True:
        batch = transport.read(task_id, offset, EVENTS_BLOCK if follow else 0.0)
        for event in batch:
            offset = event.offset
            if seen.again(event):
                continue
            if event.type == "end":
                if _resumed_after(task_id, event):
                    yield _life_ended(event)
                    continue
                yield _ended(task_id, event)
                return
            yield event
        if batch:
            continue
        if not follow:
            return
        info = get_task(task_id)
        if info.terminal:
            # Ended with its end event gone (expired, dropped) or never written (a task
            # canceled before a worker took it): what is left, then the end, from the record.
            for event in transport.read(task_id, offset, ENDED_GRACE):
                offset = event.offset
                if seen.again(event):
                    continue
                if event.type == "end":
                    if _resumed_after(task_id, event):
                        yield _life_ended(event)
                        continue
                    yield _ended(task_id, event)
                    return
                yield event
            yield _ended(task_id, StreamEvent(offset or "", {"type": "end", "task_id": task_id}))
            return
        if deadline is not None and time.monotonic() >= deadline:
            return


class _SeenIds:
    """The ids of the events a reader yielded, the latest ``keep`` of them: a transport
    delivers at least once, and the same fact told twice carries the same id (a call's settle:
    charlie/executor/streamed.py), so the second is dropped."""

    def __init__(self, keep: int = 10000) -> None:
        self.keep = keep
        self.ids: dict[str, None] = {}

    def again(self, event: StreamEvent) -> bool:
        event_id = event.data.get("id")
        if not isinstance(event_id, str):
            return False  # written before events had ids
        if event_id in self.ids:
            return True
        self.ids[event_id] = None
        if len(self.ids) > self.keep:
            del self.ids[next(iter(self.ids))]
        return False


def _resumed_after(task_id: str, event: StreamEvent) -> bool:
    """Whether the run was resumed after the step that wrote this ``end`` (I28: a watcher of a
    resumed task follows it to its real end, not its first life's). The end names its step
    (``end:VERSION``, charlie/executor/streamed.py); a resume records the version it re-enters
    at (I27), past that step's."""
    event_id = event.data.get("id")
    version = event.data.get("version")
    if not isinstance(version, int) and isinstance(event_id, str):
        head, _, tail = event_id.partition(":")
        version = int(tail) if head == "end" and tail.isdigit() else None
    if not isinstance(version, int):
        return False
    return any(
        a.action == Action.RESUME and int((a.detail or {}).get("version") or 0) > version + 1
        for a in people.actions(task_id)
    )


def _life_ended(event: StreamEvent) -> StreamEvent:
    """An ``end`` a resume went on from, as a watcher sees it: ``resumed``, not the end."""
    return StreamEvent(event.offset, {**event.data, "type": "resumed"})


def _ended(task_id: str, event: StreamEvent) -> StreamEvent:
    info = get_task(task_id)
    data = {**event.data, "status": info.status.value}
    if info.error is not None:
        data["error"] = info.error
    return StreamEvent(event.offset, data)


def _why_no_stream(rt: Producer) -> str:
    s = rt.settings
    if not s.streaming:
        return "streaming is off here (CHARLIE_STREAMING=0)"
    scheme = s.broker_url.split(":", 1)[0]
    return (
        f"the {scheme} broker cannot carry the event stream: set CHARLIE_STREAM_URL to a "
        "Redis (redis://HOST:6379/0) every worker and watcher can reach"
    )


def cancel(
    task_id: str,
    *,
    note: str | None = None,
    operator: str | None = None,
    request_id: str | None = None,
    origin: Origin | None = None,
) -> bool:
    """Cancel a task and its children. The run stops at its next boundary and the model is not
    called for it again (I18). False when it was already terminal. Recorded as the operator's
    action (I27)."""
    rt = get_producer()
    actor = people.actor_name(operator, rt)
    tries = 0

    def stop() -> list[str]:
        nonlocal tries
        tries += 1
        return scheduler.cancel(
            rt.engine, task_id, actor=actor, note=note, request_id=request_id, origin=origin
        )

    changed = again_if_disconnected(stop, "cancel a task")
    if tries > 1 and not changed:
        # The first try's commit may have gone through with its reply lost: count what is
        # canceled now as this call's (a task canceled just before by someone else, too).
        changed = _canceled_in_tree(rt, task_id)
    rt.poke(changed)
    return task_id in changed


@retried_if_disconnected
def _canceled_in_tree(rt: Producer, task_id: str) -> list[str]:
    tree = [task_id, *scheduler.descendants(rt.engine, task_id)]
    with read(rt.engine) as conn:
        return reads.canceled_among(conn, tree)


@retried_if_disconnected
def transcript(task_id: str) -> list[TranscriptEntry]:
    """The ordered transcript; a tool result carries its call's outcome."""
    with read(get_producer().engine) as conn:
        rows = reads.transcript_rows(conn, _execution_id(conn, task_id))
    return [
        TranscriptEntry(
            r.seq,
            r.turn,
            r.kind,
            r.call_id,
            r.payload,
            r.payload.get("outcome") if r.kind == "tool_result" else None,
        )
        for r in rows
    ]


@retried_if_disconnected
def calls(task_id: str) -> list[CallRecord]:
    """The pending-tool records of a task, in turn and call order, with their evidence."""
    with read(get_producer().engine) as conn:
        rows = reads.call_rows(conn, _execution_id(conn, task_id))
    return [
        CallRecord(
            r.call_id,
            r.turn,
            r.idx,
            r.name,
            r.arguments,
            r.effect,
            r.state,
            r.outcome,
            r.result,
            r.queued_at,
            r.dispatch_version,
            r.started_at,
            r.started_by,
            r.settled_at,
            r.settled_by,
            r.finish_order,
            r.duration_ms,
            r.attempts,
            r.handle,
            r.late_reports,
            r.late_result,
            r.deadline_at,
            r.lease_owner,
            r.lease_until,
            r.hold,
            r.hold_info,
            bool(r.resumable),
        )
        for r in rows
    ]


@retried_if_disconnected
def history(task_id: str) -> list[dict[str, Any]]:
    """Every transition of the task's run (I21): from, to, when, which worker, how long."""
    with read(get_producer().engine) as conn:
        return reads.transition_rows(conn, _execution_id(conn, task_id))


@retried_if_disconnected
def revision(task_id: str) -> str:
    """A short marker that changes whenever anything a view of the task shows changes: its
    status and usage, its run's version, phase, mailbox, transcript and wake-up (a retried
    model call's next attempt), any of its calls' dispatch, lease, hold or outcome (late
    reports too), an operator action on it, a child. One small read (indexed aggregates),
    for a page that polls to follow a run live."""
    with read(get_producer().engine) as conn:
        marker = reads.run_revision(conn, task_id, execution_id_for(task_id))
    if marker is None:
        raise TaskNotFound(task_id)
    return hashlib.sha256(repr(marker).encode()).hexdigest()[:16]


def _execution_id(conn: Connection, task_id: str) -> str:
    xid = reads.execution_id_of(conn, task_id)
    if xid is None:
        raise TaskNotFound(task_id)
    return xid


@retried_if_disconnected
def run_record(task_id: str) -> dict[str, Any]:
    """What an export of the task needs beyond get_task (charlie export, charlie/replay): the
    tools and approve lists it was submitted with, and its run's context state
    (``state["context"]``, executor/context.py) as it is, keys this code does not know kept."""
    with read(get_producer().engine) as conn:
        row = reads.task_with_run(conn, task_id)
    if row is None:
        raise TaskNotFound(task_id)
    state = row.x_state if isinstance(row.x_state, dict) else {}
    found = state.get("context")
    return {
        "tools": row.tools,
        "approve": row.approve,
        "context": found if isinstance(found, dict) else None,
    }


def limits() -> list[people.LimitState]:
    """Every provider limit used so far (CHARLIE_MODEL_LIMITS) as it is now: what is in
    flight, what waits, until when its provider paused it (I36). Lift a pause with
    ``charlie limits resume KEY`` (:func:`charlie.people.resume_limit`)."""
    return people.limit_states()
