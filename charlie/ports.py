"""What phases may call out to. The shell supplies real adapters; unit tests supply fakes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from charlie.domain import RunView, TaskStatus, utcnow
from charlie.models.base import Model, ModelRequest, Usage
from charlie.streams.sink import NO_EVENTS, EventSink
from charlie.tools.registry import ToolRegistry


class TransientSchedulerError(Exception):
    """A scheduler write that may succeed if tried again (a dropped connection, a lock)."""


class SchedulerPort(Protocol):
    def finish(
        self, task_id: str, status: TaskStatus, *, result: Any = None, error: Any = None
    ) -> bool:
        """Record a terminal status. Returns False when the task was already terminal or is
        gone: a benign outcome, not a new result (I16). Raises TransientSchedulerError."""
        ...


@dataclass(frozen=True)
class CapacitySlot:
    """A request a provider limit let through: counted in flight until released."""

    limit: str
    slot_id: int
    tokens: int


@dataclass(frozen=True)
class CapacityWait:
    """A request a provider limit holds back until ``until`` (or a release wakes it)."""

    limit: str
    until: datetime
    reason: str
    in_flight: int
    waiting: int

    def describe(self) -> str:
        return (
            f"waiting for capacity on {self.limit} "
            f"({self.in_flight} in flight, {self.waiting} waiting)"
        )


class CapacityPort(Protocol):
    """The provider limits the fleet keeps (charlie/capacity.py; I30). A model without a
    limit is None at once, with no statement."""

    def acquire(
        self, view: RunView, model: str, request: ModelRequest
    ) -> CapacitySlot | CapacityWait | None: ...

    def release(self, slot: CapacitySlot | None, usage: Usage | None) -> None: ...

    def throttled(self, slot: CapacitySlot, seconds: float) -> None: ...

    def handed_over(self) -> list[tuple[str, int]]:
        """The runs (execution id, version) whose call_model this process woke by releasing a
        slot since it last asked, cleared: the worker may run them itself once its own tick
        is done (their ticks were published too; the later one is stale, I2)."""
        ...

    def leave(self, view: RunView) -> None:
        """The run's wait for capacity ended without a slot: its place in line ends and the
        room it may have been woken for goes to the next in line."""
        ...


class NoLimits:
    """No limit declared: every call goes, nothing is counted."""

    def acquire(
        self, view: RunView, model: str, request: ModelRequest
    ) -> CapacitySlot | CapacityWait | None:
        return None

    def release(self, slot: CapacitySlot | None, usage: Usage | None) -> None:
        return None

    def throttled(self, slot: CapacitySlot, seconds: float) -> None:
        return None

    def handed_over(self) -> list[tuple[str, int]]:
        return []

    def leave(self, view: RunView) -> None:
        return None


NO_LIMITS = NoLimits()


@dataclass(frozen=True)
class PhaseLimits:
    dispatch_batch: int = 8
    tool_deadline: float = 300.0
    human_deadline: float = 86400.0
    report_retries: int = 4
    report_backoff: float = 0.05
    #: a backstop on how many times the executor asks again; the time bound below decides first
    model_retries: int = 100
    #: how long a failing model call is retried, from its first failure (I36)
    model_retry_seconds: float = 600.0
    #: the context window of a model without one of its own (CHARLIE_MODEL_CONTEXT_TOKENS);
    #: None: learned from the provider's refusal (executor/context.py)
    context_tokens: int | None = None
    #: per model, by ``<NAME>`` as in CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS
    context_tokens_by_model: dict[str, int] = field(default_factory=dict)


@dataclass
class PhaseDeps:
    model_for: Callable[[str], Model]
    tools: ToolRegistry
    scheduler: SchedulerPort
    limits: PhaseLimits = field(default_factory=PhaseLimits)
    #: where the model call's stream goes, for people watching (I28: never read back)
    events: EventSink = NO_EVENTS
    #: the provider limits the fleet keeps: asked before each model call
    capacity: CapacityPort = NO_LIMITS
    sleep: Callable[[float], None] = time.sleep
    #: the worker these phases run in (a retry's waits are drawn on its lane, I36)
    worker: str = ""
    #: the time now: when a model call's failure came back, after the claim's ``view.now``
    clock: Callable[[], datetime] = utcnow
