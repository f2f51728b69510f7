"""What phases may call out to. The shell supplies real adapters; unit tests supply fakes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from charlie.domain import TaskStatus
from charlie.models.base import Model
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
class PhaseLimits:
    dispatch_batch: int = 8
    tool_deadline: float = 300.0
    human_deadline: float = 86400.0
    report_retries: int = 4
    report_backoff: float = 0.05
    model_retries: int = 8
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
    sleep: Callable[[float], None] = time.sleep
