"""The vocabulary of a run: phases, statuses, outcomes and the typed records phases work on.

Nothing here imports Celery or SQLAlchemy: these are the values the functional core reads and
returns, and the shell (store, tick, tools) translates them to rows and messages.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]

#: Task ids are at most this long, so that the execution id (a prefix + the task id) fits its
#: column.
MAX_TASK_ID = 120
#: what a task id may be: letters, digits and ._:- (it names queues' messages and paths).
TASK_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_TASK_ID - 1}}}$")


def utcnow() -> datetime:
    """Every recorded time is timezone-aware UTC, taken from the worker's clock."""
    return datetime.now(UTC)


def execution_id_for(task_id: str) -> str:
    """A task has exactly one execution; its id is derived, so it never needs a lookup."""
    return f"x-{task_id}"


def task_id_of(execution_id: str) -> str:
    if not execution_id.startswith("x-"):
        raise ValueError(f"{execution_id!r} is not an execution id")
    return execution_id[2:]


class Phase(enum.StrEnum):
    """I1: the phase an execution row is in is the instruction the next tick follows."""

    LOAD_CONTEXT = "load_context"
    CALL_MODEL = "call_model"
    DISPATCH_TOOLS = "dispatch_tools"
    AWAIT_TOOLS = "await_tools"
    ADVANCE_TURN = "advance_turn"
    REPORT_TERMINAL = "report_terminal"
    REPORT_FAILURE = "report_failure"
    DONE = "done"


#: phases that end a run: a canceled or timed-out task is not diverted from them (I18).
ENDING_PHASES = frozenset({Phase.REPORT_TERMINAL, Phase.REPORT_FAILURE, Phase.DONE})


class TaskStatus(enum.StrEnum):
    """I18: the scheduler's lifecycle of a task."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELED, TaskStatus.TIMED_OUT}
)


class ItemKind(enum.StrEnum):
    INPUT = "input"
    MESSAGE = "message"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    FINAL = "final"
    #: a summary of earlier items, standing for them in the model input (I29); the items it
    #: covers stay in the record untouched
    COMPACTION = "compaction"


class CallState(enum.StrEnum):
    PENDING = "pending"
    STARTED = "started"
    SETTLED = "settled"


class Outcome(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    INTERRUPTED = "interrupted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELED = "canceled"
    #: a person declined the call before it was dispatched; it never ran (I23).
    DENIED = "denied"


class Hold(enum.StrEnum):
    """Why an open call waits for a person rather than a worker (I23, I25)."""

    #: needs an approve (or a deny) before it is dispatched; never marked started before.
    APPROVAL = "approval"
    #: a question (``ask_human``): a person's reply is its result.
    REPLY = "reply"
    #: it was started and interrupted, and its tool holds uncertainty for an operator's verdict.
    RECONCILE = "reconcile"


class OnInterrupt(enum.StrEnum):
    """What an interrupted call of a tool becomes when no reconcile hook could settle it."""

    REPORT = "report"
    HOLD = "hold"


class Action(enum.StrEnum):
    """What an operator did (I27): every one is a durable row."""

    SEND = "send"
    REPLY = "reply"
    APPROVE = "approve"
    DENY = "deny"
    RECONCILE = "reconcile"
    RESUME = "resume"
    FORK = "fork"
    CANCEL = "cancel"


#: the actions that decide a call: the first of them wins (I24).
VERDICTS = frozenset({Action.REPLY, Action.APPROVE, Action.DENY, Action.RECONCILE})


class Channel(enum.StrEnum):
    """How an operator action reached Charlie (I32)."""

    #: the Python API, called in-process (a producer's code)
    API = "api"
    #: the ``charlie`` command line
    CLI = "cli"
    #: the run console (``charlie ui``)
    UI = "ui"
    #: a Celery message naming the action's task (``charlie.approve``...) on the broker
    CELERY = "celery"


#: how each channel is said in a record's description
CHANNEL_NAMES = {
    Channel.API: "Python API",
    Channel.CLI: "CLI",
    Channel.UI: "console",
    Channel.CELERY: "celery",
}


@dataclass(frozen=True)
class Origin:
    """Where an operator action came from (I32): its channel, and whether the actor's name was
    established by that channel (the console's token, checked on this request) or is only what
    the caller claimed (every other channel: an ``operator=`` argument, CHARLIE_OPERATOR, the
    OS user, a broker message's keyword)."""

    channel: Channel = Channel.API
    authenticated: bool = False


#: how much of a name a record shows: the part that says how it is known always follows it
SHOWN_NAME = 60


def shown_name(actor: str) -> str:
    """A name as a record shows it: one line of printable text, at most SHOWN_NAME characters,
    so a claimed name can neither push the words after it out of a truncated line nor hide them
    with a terminal's escape sequences."""
    text = "".join(c if c.isprintable() else " " for c in actor)
    text = " ".join(text.split()) or "?"
    return text if len(text) <= SHOWN_NAME else text[: SHOWN_NAME - 1] + "…"


def describe_actor(actor: str, channel: str | None, authenticated: bool | None) -> str:
    """Who did an action and how that is known, as a record shows it (I32):
    ``alice (console, signed in)`` for the console's own signed-in session (its ``ui:`` prefix
    dropped), ``ui:alice (claimed, via celery)`` for a name a broker message asserted.
    ``channel`` None: the action was recorded before channels were (claimed, how unknown)."""
    actor = shown_name(actor)
    if channel is None:
        return f"{actor} (claimed, channel not recorded)"
    try:
        name = CHANNEL_NAMES[Channel(channel)]
    except ValueError:
        name = channel
    if authenticated:
        shown = actor.removeprefix("ui:") if channel == Channel.UI.value else actor
        return f"{shown} ({name}, signed in)"
    return f"{actor} (claimed, via {name})"


class Effect(enum.StrEnum):
    """What a tool does to the world; decides what recovery may do with an interrupted call."""

    READ = "read"
    WRITE = "write"
    WAIT = "wait"


@dataclass(frozen=True)
class TaskView:
    id: str
    prompt: str
    model: str
    tools: list[str] | None
    metadata: JSON
    status: TaskStatus
    parent_id: str | None
    timeout_at: datetime | None
    #: tool names whose calls wait for an approve in this task (``submit(approve=...)``).
    approve: list[str] | None = None
    #: the task's budget (``submit(budget=...)``); loaded only by call_model's claim,
    #: the one boundary that checks it (None in other phases).
    budget: JSON | None = None
    #: the durable usage the budget counts (input/output/reasoning tokens, model_calls);
    #: loaded only with a budget, in call_model.
    usage: JSON | None = None
    #: whether it has started a child task (delegate); read with the budget, in call_model.
    delegated: bool = False
    #: a budgeted task in a delegation tree (it has a parent or children): the spend of the
    #: tree under its farthest budgeted ancestor (itself, for a root), one row per task, so the
    #: boundary checks its own budget and every ancestor's against what each one's subtree has
    #: spent. Loaded only for call_model's boundary; None outside a tree.
    tree: tuple[TaskSpend, ...] | None = None


@dataclass(frozen=True)
class TaskSpend:
    """One task of a delegation tree, with its budget and its durable usage."""

    task_id: str
    parent_id: str | None
    model: str
    budget: JSON | None
    #: input_tokens, output_tokens, reasoning_tokens, model_calls
    usage: JSON


@dataclass(frozen=True)
class Message:
    """A person's message waiting in a run's mailbox for its next turn boundary (I22)."""

    id: int
    message_id: str
    text: str
    sent_by: str


@dataclass(frozen=True)
class Item:
    """A transcript item as committed: the model-visible chronology (I6)."""

    seq: int
    turn: int
    kind: ItemKind
    call_id: str | None
    payload: JSON


@dataclass(frozen=True)
class NewItem:
    kind: ItemKind
    payload: JSON
    call_id: str | None = None


@dataclass(frozen=True)
class CallView:
    """A tool call's pending-tool record, as a phase sees it."""

    call_id: str
    turn: int
    index: int
    name: str
    arguments: JSON
    state: CallState
    outcome: Outcome | None
    result: JSON | None
    queued_at: datetime | None
    started_at: datetime | None
    settled_at: datetime | None
    deadline_at: datetime | None
    #: the lease a worker holds it under (owner, attempt count): a holder's settle checks it.
    lease_owner: str | None = None
    attempts: int = 0
    #: what a person must do before the call can settle, if anything (I23).
    hold: Hold | None = None
    #: why it is held (for a reconcile: the interruption's evidence).
    hold_info: JSON | None = None
    #: who settled it: a worker, ``sweep@...``, ``operator:NAME`` (a person's verdict)
    settled_by: str | None = None


@dataclass(frozen=True)
class NewCall:
    """A tool call the model asked for. A call that can never run (unknown tool, invalid
    arguments) is born settled with an error outcome, so it still gets exactly one result (I8)."""

    call_id: str
    index: int
    name: str
    arguments: JSON
    effect: Effect
    resumable: bool
    settled: tuple[Outcome, JSON] | None = None
    hold: Hold | None = None
    hold_info: JSON | None = None
    on_interrupt: OnInterrupt = OnInterrupt.REPORT


@dataclass(frozen=True)
class Settlement:
    call_id: str
    outcome: Outcome
    result: JSON
    #: how long the handler ran, when a handler produced this outcome.
    duration_ms: float | None = None


@dataclass(frozen=True)
class RunView:
    """Everything a phase may read: the execution row, its task, and what the phase asked for."""

    execution_id: str
    phase: Phase
    version: int
    turn: int
    state: JSON
    attempts: int
    task: TaskView
    now: datetime
    items: list[Item] = field(default_factory=list)
    calls: list[CallView] = field(default_factory=list)
    last_error: JSON | None = None
    #: the messages waiting for this boundary, in commit order (loaded only when some are).
    messages: list[Message] = field(default_factory=list)
    #: what this process already knows of ``items``: (n, k), the newest ``compaction`` item
    #: among ``items[:n]`` is at index k (-1: none); None when nothing is known. It holds of
    #: these ``items`` only: a view given other items must not keep it (the planning trusts it)
    compaction_known: tuple[int, int] | None = None


@dataclass
class Transition:
    """What a phase decided: written by the shell in one transaction (I1), published after."""

    to: Phase | None
    """The next phase; ``None`` means stay in this phase without a new version (a wait)."""
    state: JSON | None = None
    items: list[NewItem] = field(default_factory=list)
    calls: list[NewCall] = field(default_factory=list)
    queue_calls: list[tuple[str, datetime]] = field(default_factory=list)
    """Calls to mark queued for dispatch, with their deadlines; each gets an invoke message."""
    ask_calls: list[tuple[str, datetime]] = field(default_factory=list)
    """Questions to a person: queued with their deadlines like the above, but no worker is
    sent (a reply settles them, I25)."""
    take_messages: list[tuple[int, int]] = field(default_factory=list)
    """Mailbox messages this transition enters into the transcript: (message row id, index of
    its item in ``items``), marked delivered in the same transaction (I22)."""
    settle: list[Settlement] = field(default_factory=list)
    finish_order: dict[str, int] = field(default_factory=dict)
    next_turn: bool = False
    task_status: TaskStatus | None = None
    wake_at: datetime | None = None
    publish_next: bool = True
    note: str | None = None
    model_calls: int = 0
    model_repeats: int = 0
    usage: JSON | None = None

    @classmethod
    def wait(cls, wake_at: datetime | None = None, note: str | None = None) -> Transition:
        return cls(to=None, wake_at=wake_at, publish_next=False, note=note)
