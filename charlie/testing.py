"""Testing tools without a cluster, and the fakes of Charlie's ports.

:class:`ToolEnvironment` runs one tool the way a worker does (temporalio's
``ActivityEnvironment`` is the model): its arguments validated against the schema the model is
shown, its handler called with a :class:`~charlie.tools.ToolContext`, a ``ToolError`` or any
other exception turned into the ``error`` result the model would see (I15), a ``Pending`` kept
as the wait it is (I10), and the reconcile hook run for a call found started without a result,
giving the ``Reconciled`` outcome (I10). No database, no broker, no worker::

    from charlie.domain import Outcome
    from charlie.testing import ToolEnvironment

    (tmp_path / "README.md").write_text("hello")
    env = ToolEnvironment(workspace=tmp_path)
    done = env.run("read_file", path="README.md")
    assert done.outcome is Outcome.OK

A tool of your own is looked up by name once its module is imported (importing it registers
it); docs/examples/ has one with a reconcile hook, and its test.

:func:`replay` replays an exported case (``charlie export``) with today's code and returns what
diverged, so a directory of cases is a regression suite (docs/replay.md).

The fakes stand in for the ports the engine hands to phases and tools: :class:`FakeModel`
(a Model), :class:`FakeScheduler` (the phases' SchedulerPort), :class:`FakeChildren` (a
ToolContext's Children) and :class:`RecordingPublisher` (the publisher of ticks and calls).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from charlie.domain import JSON, Outcome, Phase, TaskStatus, execution_id_for
from charlie.models.base import ModelRequest, ModelResponse
from charlie.ports import TransientSchedulerError
from charlie.tools.calling import cap_result, run_handler, run_reconcile
from charlie.tools.context import AskPerson, ChildSubmitted, Pending, TaskSnapshot, ToolContext
from charlie.tools.registry import REGISTRY, ToolDef, ToolRegistry, build_tool

__all__ = [
    "FakeChildren",
    "FakeModel",
    "FakeScheduler",
    "RecordingPublisher",
    "ToolEnvironment",
    "ToolOutcome",
    "replay",
]

#: A worker's default cap on a result (CHARLIE_MAX_RESULT_BYTES).
MAX_RESULT_BYTES = 256 * 1024


@dataclass(frozen=True)
class ToolOutcome:
    """What one call of a tool came to."""

    #: ``ok``, ``error``, or for a reconcile the hook's finding (``interrupted`` if none).
    outcome: Outcome
    #: the result as it would be settled (capped like a worker's); None while pending.
    result: Any
    #: set when a resumable wait is still waiting: the call would park and be resumed.
    pending: Pending | None = None
    #: the handle the call recorded (ctx.record_handle), if any.
    handle: str | None = None
    #: set when the call asks a person (an AskPerson): it would park held for a reply.
    asked: AskPerson | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK and self.pending is None and self.asked is None


@dataclass
class ToolEnvironment:
    """Run one tool as a worker would, in this process.

    ``registry``: where tool names are looked up (the process's, with the built-ins and every
    ``@charlie.tool``, by default). ``workspace``: the call's working directory (a temporary
    one by default). ``children``: the Children port, a :class:`FakeChildren` by default."""

    workspace: Path | None = None
    task_id: str = "test-task"
    call_id: str = "call-1"
    turn: int = 0
    metadata: JSON = field(default_factory=dict)
    registry: ToolRegistry = field(default_factory=lambda: REGISTRY)
    children: Any = None
    max_result_bytes: int = MAX_RESULT_BYTES

    def __post_init__(self) -> None:
        if self.workspace is None:
            self.workspace = Path(tempfile.mkdtemp(prefix="charlie-tool-"))
        if self.children is None:
            # Its own task is there to be read, as a delegate reads its parent.
            self.children = FakeChildren()
            self.children.add(self.task_id, metadata=self.metadata)

    def run(self, tool: str | ToolDef | Callable[..., Any], /, **arguments: Any) -> ToolOutcome:
        """Call the tool's handler as a first attempt."""
        return self._call(tool, arguments, mode="start", handle=None)

    def resume(
        self, tool: str | ToolDef | Callable[..., Any], /, handle: str, **arguments: Any
    ) -> ToolOutcome:
        """Call a resumable wait again after a crash or a poll, with the handle it recorded
        (``ctx.resumed`` is True, ``ctx.handle`` set), as the engine does (I10, I19)."""
        return self._call(tool, arguments, mode="resume", handle=handle)

    def reply(
        self,
        tool: str | ToolDef | Callable[..., Any],
        /,
        asked: ToolOutcome,
        text: str,
        **arguments: Any,
    ) -> ToolOutcome:
        """Call a tool again with a person's answer to the question it asked (``asked``, the
        outcome that carried its AskPerson), as the engine does after ``charlie.reply``:
        resumed, ``ctx.answer`` the text, ``ctx.asked`` the question's state."""
        if asked.asked is None:
            raise ValueError("that outcome asked no question")
        return self._call(
            tool,
            arguments,
            mode="resume",
            handle=asked.handle,
            answer=text,
            state=asked.asked.state,
        )

    def observe(
        self, tool: str | ToolDef | Callable[..., Any], /, handle: str, **arguments: Any
    ) -> ToolOutcome:
        """One more look at a wait settled past its deadline (``ctx.overdue``, I13)."""
        return self._call(tool, arguments, mode="observe", handle=handle)

    def reconcile(
        self,
        tool: str | ToolDef | Callable[..., Any],
        /,
        handle: str | None = None,
        evidence: JSON | None = None,
        **arguments: Any,
    ) -> ToolOutcome:
        """Run the tool's reconcile hook, as for a call found started without a result (I10):
        its ``Reconciled`` finding, or ``interrupted`` when it cannot tell."""
        return self._call(tool, arguments, mode="reconcile", handle=handle, evidence=evidence)

    def definition(self, tool: str | ToolDef | Callable[..., Any]) -> ToolDef:
        if isinstance(tool, ToolDef):
            return tool
        if isinstance(tool, str):
            found = self.registry.get(tool)
            if found is None:
                raise LookupError(f"tool {tool!r} is not registered here")
            return found
        registered = next((t for t in self.registry.enabled(None) if t.handler is tool), None)
        return registered or build_tool(tool)

    def _call(
        self,
        tool: str | ToolDef | Callable[..., Any],
        arguments: JSON,
        *,
        mode: str,
        handle: str | None,
        evidence: JSON | None = None,
        answer: str | None = None,
        state: JSON | None = None,
    ) -> ToolOutcome:
        definition = self.definition(tool)
        problem = definition.validate(arguments)
        if problem:
            # What the model is told when its arguments do not fit the schema (I15).
            return ToolOutcome(Outcome.ERROR, {"error": problem})
        recorded: list[str] = []
        assert self.workspace is not None
        self.workspace.mkdir(parents=True, exist_ok=True)
        ctx = ToolContext(
            task_id=self.task_id,
            execution_id=execution_id_for(self.task_id),
            call_id=self.call_id,
            turn=self.turn,
            workspace=self.workspace,
            metadata=self.metadata,
            resumed=mode in ("resume", "observe"),
            handle=handle,
            _record_handle=recorded.append,
            overdue=mode == "observe",
            children=self.children,
            answer=answer,
            asked=state if answer is not None else None,
        )
        if mode == "reconcile":
            if definition.reconcile is None:
                raise ValueError(f"tool {definition.name!r} declares no reconcile hook")
            base = {"started_at": None, "started_by": "test", "attempts": 1, "handle": handle}
            outcome, result = run_reconcile(
                definition, arguments, ctx, {**base, **(evidence or {})}
            )
        else:
            outcome, result = run_handler(definition, arguments, ctx)
        handle_now = recorded[-1] if recorded else handle
        if isinstance(result, Pending | AskPerson):
            if outcome is Outcome.OK and (definition.resumable or definition.parks):
                if isinstance(result, AskPerson):
                    return ToolOutcome(Outcome.OK, None, handle=result.handle, asked=result)
                return ToolOutcome(Outcome.OK, None, pending=result, handle=result.handle)
            return ToolOutcome(
                Outcome.ERROR, {"error": f"{definition.name!r} is not a resumable wait"}
            )
        return ToolOutcome(outcome, cap_result(result, self.max_result_bytes), handle=handle_now)


@dataclass
class FakeChildren:
    """An in-memory Children port: tasks a tool starts are recorded, and a test sets how they
    end with :meth:`finish`."""

    tasks: dict[str, TaskSnapshot] = field(default_factory=dict)
    submitted: list[dict[str, Any]] = field(default_factory=list)
    #: the model of a task added without one.
    default_model: str = "scripted:fake"

    def add(
        self,
        task_id: str,
        *,
        model: str | None = None,
        metadata: JSON | None = None,
        parent_id: str | None = None,
        tools: list[str] | None = None,
    ) -> None:
        self.tasks[task_id] = TaskSnapshot(
            task_id,
            TaskStatus.RUNNING,
            None,
            None,
            model or self.default_model,
            metadata or {},
            parent_id=parent_id,
            tools=tools,
        )

    def finish(
        self,
        task_id: str,
        status: TaskStatus = TaskStatus.SUCCEEDED,
        result: Any = None,
        error: Any = None,
    ) -> None:
        task = self.tasks[task_id]
        self.tasks[task_id] = TaskSnapshot(
            task_id,
            status,
            result,
            error,
            task.model,
            task.metadata,
            parent_id=task.parent_id,
            tools=task.tools,
        )

    def get(self, task_id: str) -> TaskSnapshot | None:
        return self.tasks.get(task_id)

    def submit(
        self,
        *,
        prompt: str,
        model: str,
        tools: list[str] | None,
        task_id: str,
        metadata: JSON,
        parent_id: str,
        parent_call_id: str,
    ) -> ChildSubmitted:
        if task_id in self.tasks:
            return ChildSubmitted(task_id, created=False)  # idempotent on the id (I19)
        self.submitted.append(
            {
                "prompt": prompt,
                "model": model,
                "tools": tools,
                "task_id": task_id,
                "metadata": metadata,
                "parent_id": parent_id,
                "parent_call_id": parent_call_id,
            }
        )
        self.add(task_id, model=model, metadata=metadata, parent_id=parent_id, tools=tools)
        return ChildSubmitted(task_id, created=True)


class FakeModel:
    """A Model that answers every request with one response (or raises one exception), and
    keeps the requests it was sent."""

    spec = "fake:1"

    def __init__(self, response: ModelResponse | Exception) -> None:
        self.response = response
        self.requests: list[ModelRequest] = []

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        if isinstance(self.response, Exception):
            raise self.response
        return self.response


class FakeScheduler:
    """The phases' SchedulerPort: records finishes; fails the first ``failures`` of them with
    a TransientSchedulerError; answers ``accept`` (False: the task was terminal already)."""

    def __init__(self, failures: int = 0, accept: bool = True) -> None:
        self.failures = failures
        self.accept = accept
        self.calls: list[tuple[str, TaskStatus, Any]] = []

    def finish(
        self, task_id: str, status: TaskStatus, *, result: Any = None, error: Any = None
    ) -> bool:
        self.calls.append((task_id, status, result))
        if self.failures:
            self.failures -= 1
            raise TransientSchedulerError("db went away")
        return self.accept


class RecordingPublisher:
    """Stands in for the broker: records the ticks and invocations it is asked to publish, and
    the priority each run's last message was given (None: none, the Celery task's own)."""

    def __init__(self) -> None:
        self.ticks: list[tuple[str, Phase, int]] = []
        self.invokes: list[tuple[str, int, str, str]] = []
        self.priorities: dict[str, int | None] = {}
        #: every message in order, as JSON lists: ["tick", id, phase, version, durable] or
        #: ["invoke", id, turn, call, mode] (the two-beats test's sweeper prints them)
        self.sent: list[list[Any]] = []

    def tick(
        self,
        execution_id: str,
        phase: Phase,
        version: int,
        *,
        durable: bool = False,
        priority: int | None = None,
    ) -> bool:
        self.ticks.append((execution_id, phase, version))
        self.sent.append(["tick", execution_id, phase.value, version, durable])
        self.priorities[execution_id] = priority
        return True

    def invoke(
        self,
        execution_id: str,
        turn: int,
        call_id: str,
        mode: str = "start",
        *,
        priority: int | None = None,
    ) -> bool:
        self.invokes.append((execution_id, turn, call_id, mode))
        self.sent.append(["invoke", execution_id, turn, call_id, mode])
        self.priorities[execution_id] = priority
        return True

    def many(self, messages: Any, *, priority: int | None = None) -> None:
        for name, args in messages:
            if name == "charlie.tool.invoke":
                self.invoke(*args, priority=priority)
            else:
                self.tick(args[0], Phase(name.rsplit(".", 1)[1]), args[1], priority=priority)


def replay(
    case: str | Path,
    *,
    tools: ToolRegistry | None = None,
    workspace: str | Path | None = None,
    run_writes: bool = False,
) -> Any:
    """Replay the exported case in ``case`` with today's code, in this process, on the file
    alone (I35): the model's answers from the record, reads run again, writes not run (their
    recorded results stand in) unless ``run_writes``, and then in a scratch copy of
    ``workspace``. Returns the :class:`charlie.replay.engine.ReplayReport`: ``.diverged``,
    ``.divergences`` (each with ``turn``, ``call_id``, ``tool``, ``kind``, ``recorded``,
    ``new``), ``.exit_code``, ``.render()``. A case that cannot be read raises
    :class:`charlie.replay.case.CaseError`. ``tools``: the registry to replay with (the
    process's, with every imported ``@charlie.tool``, by default)."""
    from charlie.replay.case import load_case
    from charlie.replay.engine import replay_case

    loaded = load_case(Path(case))
    return replay_case(
        loaded,
        tools=tools,
        workspace=Path(workspace) if workspace is not None else None,
        run_writes=run_writes,
    )
