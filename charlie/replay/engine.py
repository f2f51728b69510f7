"""Replay a recorded task with today's code, on its exported case alone (I35).

The run is driven through the same phase functions the workers run (``executor.phases``:
load_context, call_model, dispatch_tools, await_tools, advance_turn), each given a view built
from what the replay has written so far and its transition applied in memory; the ports answer
from the record:

- the model (``RecordedModel``) answers each call with the recorded answer of its turn, and a
  compaction's summary call with the recorded summary, and keeps every request it is sent: the
  input today's code would send;
- a call of a tool whose recorded effect is ``read`` (and today's too) runs again with today's
  handler in a scratch workspace; every other call (a write, a wait, a delegation, a question to
  a person) is settled with its recorded outcome and result, and its handler is never called,
  unless ``run_writes``, and then only in that scratch workspace, never the original;
- a call of a tool that talks to a service of the deployment (``ToolDef.remote``: the devbox's
  tools, an MCP server's) is never run, a read's neither: its recorded result stands in;
- people's verdicts and answers come from the record: a denied call is settled with its
  recorded denial, an approved one runs as the record says it ran.

Nothing here opens a database, a broker or a connection of any kind. What differs from the
record is a :class:`Divergence`; the case's recorded inputs (``model_calls``) were computed by
the exporting process with this same driver, every call standing in (``capture``), so a
difference in the input is a difference of the code, turn by turn.
"""

from __future__ import annotations

import difflib
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from charlie.domain import (
    JSON,
    CallState,
    CallView,
    Effect,
    Hold,
    Item,
    ItemKind,
    Message,
    NewItem,
    Outcome,
    Phase,
    RunView,
    TaskStatus,
    TaskView,
    Transition,
    execution_id_for,
)
from charlie.executor import context
from charlie.executor.phases import run_phase
from charlie.models.base import ModelError, ModelRequest, ModelResponse, Usage
from charlie.ports import PhaseDeps, PhaseLimits
from charlie.replay.case import CaseError
from charlie.terminal import printable
from charlie.tools.calling import cap_result, run_handler
from charlie.tools.context import (
    AskPerson,
    ChildSubmitted,
    Pending,
    TaskSnapshot,
    ToolContext,
    ToolError,
)
from charlie.tools.registry import REGISTRY, ToolRegistry

#: the kinds of divergence (docs/reference/case-format.md)
KINDS = (
    "read_result",
    "write_result",
    "tool_gone",
    "arguments_invalid",
    "tool_schema",
    "system_prompt",
    "rendering",
    "input",
    "context_plan",
    "run_failed",
)
#: kinds after which the case cannot be replayed as a whole (exit 2)
UNREPLAYABLE = frozenset({"tool_gone"})
#: a diff shows at most this many lines, each at most this long
DIFF_LINES = 40
DIFF_WIDTH = 200
#: a replay takes at most this many steps (a record is finite; this stops a code change that
#: loops between phases)
MAX_STEPS = 10_000
#: the clock the replayed run sees: fixed, so no deadline passes while it replays
CLOCK = datetime(2000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Divergence:
    """One place where today's code does not do what the record did."""

    #: the turn (counting from 0) where it shows; None: not one turn's (a tool's schema)
    turn: int | None
    call_id: str | None
    tool: str | None
    #: one of KINDS
    kind: str
    #: what the record holds, and what today's code gave (JSON values)
    recorded: Any
    new: Any
    #: how it differs, in a sentence (and a bounded diff, when there is one)
    how: str
    #: the task it belongs to (a delegated child's id, for a child's divergence)
    task_id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "turn": self.turn,
            "call_id": self.call_id,
            "tool": self.tool,
            "kind": self.kind,
            "recorded": self.recorded,
            "new": self.new,
            "how": self.how,
        }


@dataclass
class ReplayReport:
    """What a replay found: ``diverged`` (something differs), ``divergences`` (each with its
    turn, call id, tool, kind, recorded and new values), ``lines`` (the report, turn by turn),
    ``problems`` (why the case, or part of it, cannot be replayed)."""

    task_id: str
    lines: list[str] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: the model inputs the replay sent, in order (what an export records)
    model_calls: list[dict[str, Any]] = field(default_factory=list)
    children: list[ReplayReport] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return bool(self.all_divergences())

    @property
    def replayable(self) -> bool:
        return not self.all_problems() and not any(
            d.kind in UNREPLAYABLE for d in self.all_divergences()
        )

    def all_divergences(self) -> list[Divergence]:
        return [*self.divergences, *(d for c in self.children for d in c.all_divergences())]

    def all_problems(self) -> list[str]:
        return [*self.problems, *(p for c in self.children for p in c.all_problems())]

    @property
    def exit_code(self) -> int:
        """0: nothing diverged; 1: something did; 2: the case cannot be replayed (a tool
        gone, an incompatible case)."""
        if not self.replayable:
            return 2
        return 1 if self.diverged else 0

    def render(self) -> str:
        """The report for a terminal: every text a model, a tool or a person wrote is shown,
        never obeyed (charlie.terminal)."""
        out = [printable(line, multiline=True) for line in self.lines]
        for child in self.children:
            out.append("")
            out.append(printable(f"delegated task {child.task_id}:"))
            out.extend("    " + line for line in child.render().splitlines())
        if self.children:
            out.append("")
        out.append(self.summary())  # the task's and its delegated tasks' together
        return "\n".join(out)

    def summary(self) -> str:
        found = self.all_divergences()
        problems = self.all_problems()
        if problems:
            head = "cannot be replayed: " + "; ".join(problems)
        elif any(d.kind in UNREPLAYABLE for d in found):
            head = "cannot be replayed as recorded: a tool the record calls is gone"
        elif found:
            head = f"diverged: {len(found)} divergence(s)"
        else:
            head = "nothing diverged"
        return printable(f"replay of {self.task_id}: {head}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "diverged": self.diverged,
            "exit_code": self.exit_code,
            "problems": self.all_problems(),
            "divergences": [d.as_dict() for d in self.all_divergences()],
        }


class RecordEnds(Exception):
    """The record holds no answer for the model call asked for: the recorded run ended there
    (it failed, was canceled, or is still running)."""


# -- rendering ------------------------------------------------------------------------------


def render_item(item: Item) -> dict[str, Any]:
    """An input item as the model is shown it, for the case and for comparing."""
    payload = item.payload
    if item.kind is ItemKind.TOOL_CALL:
        text = f"{payload.get('name')}({payload.get('raw_arguments', '')})"
    elif item.kind is ItemKind.REASONING:
        raw = payload.get("raw")
        text = json.dumps(raw, sort_keys=True) if raw is not None else str(payload.get("summary"))
    else:
        text = str(payload.get("content") or "")
    out: dict[str, Any] = {"seq": item.seq, "kind": item.kind.value, "text": text}
    if item.call_id is not None:
        out["call_id"] = item.call_id
    if payload.get("role") is not None:
        out["role"] = payload.get("role")
    return out


def bounded_diff(recorded: Any, new: Any) -> str:
    """A unified diff of two values' JSON, at most DIFF_LINES lines of DIFF_WIDTH characters."""

    def lines(value: Any) -> list[str]:
        text = value if isinstance(value, str) else json.dumps(value, indent=1, sort_keys=True)
        return text.splitlines() or [""]

    diff = list(
        difflib.unified_diff(lines(recorded), lines(new), "recorded", "today", n=1, lineterm="")
    )
    shown = [d if len(d) <= DIFF_WIDTH else d[: DIFF_WIDTH - 1] + "…" for d in diff[:DIFF_LINES]]
    if len(diff) > DIFF_LINES:
        shown.append(f"... ({len(diff) - DIFF_LINES} more lines of diff)")
    return "\n".join(shown)


def _short(value: Any, limit: int = 100) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(printable(text, multiline=True).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- ports answering from the record --------------------------------------------------------


class RecordedModel:
    """The model port: the recorded answer of each turn, in order; a compaction's summary
    call answered with the recorded summary. Every request is kept (``requests``)."""

    spec = "replay:recorded"

    def __init__(self, run: _Replay) -> None:
        self.run = run
        self.requests: list[ModelRequest] = []

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        run = self.run
        if request.purpose == "summary":
            recorded = run.take_compaction(request.turn)
            if recorded is None:
                run.diverge(
                    request.turn,
                    "context_plan",
                    None,
                    "a summary call",
                    "today's code compacts the input before this turn; the record did not",
                )
                text = "(replay: no summary recorded here)"
            else:
                text = str(recorded.payload.get("content") or "")
            return ModelResponse(
                output=[NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text})],
                usage=Usage(),
            )
        skipped = run.skip_compactions(request.turn)
        if skipped:
            run.diverge(
                request.turn,
                "context_plan",
                "a summary call",
                None,
                "the record compacted the input before this turn; today's code does not",
            )
        answer = run.answers.get(request.turn)
        if answer is None:
            raise RecordEnds(f"the record has no model answer for turn {request.turn}")
        return ModelResponse(output=list(answer), usage=Usage())


@dataclass
class _Children:
    """The Children port of a replayed call: the recorded tasks to read; no task is started."""

    tasks: dict[str, TaskSnapshot]

    def get(self, task_id: str) -> TaskSnapshot | None:
        return self.tasks.get(task_id)

    def submit(self, **_: Any) -> ChildSubmitted:
        raise ToolError("a replay starts no task (the record's child stands in)")


@dataclass
class _Record:
    """The Record port (the ``recall`` tool): results from the replay's transcript."""

    items: list[Item]

    def result_of(self, execution_id: str, call_id: str) -> JSON | None:
        for item in reversed(self.items):
            if item.kind is ItemKind.TOOL_RESULT and item.call_id == call_id:
                return dict(item.payload)
        return None


# -- the driver -----------------------------------------------------------------------------


def _item(row: dict[str, Any]) -> Item:
    return Item(
        int(row["seq"]),
        int(row["turn"]),
        ItemKind(row["kind"]),
        row.get("call_id"),
        dict(row.get("payload") or {}),
    )


def _answers(transcript: list[Item]) -> dict[int, list[NewItem]]:
    """Each turn's model answer as the model returned it: its reasoning, messages and tool
    calls, and the final answer as the message it was (call_model makes it the final item)."""
    answers: dict[int, list[NewItem]] = {}
    for item in transcript:
        if item.kind in (ItemKind.REASONING, ItemKind.MESSAGE, ItemKind.TOOL_CALL):
            answers.setdefault(item.turn, []).append(
                NewItem(item.kind, dict(item.payload), call_id=item.call_id)
            )
        elif item.kind is ItemKind.FINAL:
            answers.setdefault(item.turn, []).append(
                NewItem(
                    ItemKind.MESSAGE,
                    {"role": "assistant", "content": item.payload.get("content", "")},
                )
            )
    return answers


class _Replay:
    def __init__(
        self,
        case: dict[str, Any],
        tools: ToolRegistry,
        workspace: Path,
        *,
        run_writes: bool,
        capture: bool,
    ) -> None:
        self.case = case
        self.tools = tools
        self.workspace = workspace
        self.run_writes = run_writes
        self.capture = capture
        t = case["task"]
        self.task = TaskView(
            id=t["id"],
            prompt=t["prompt"],
            model=t["model"],
            tools=t.get("tools"),
            metadata=dict(t.get("metadata") or {}),
            status=TaskStatus.QUEUED,
            parent_id=t.get("parent_id"),
            timeout_at=None,
            approve=t.get("approve"),
        )
        self.execution_id = execution_id_for(self.task.id)
        self.report = ReplayReport(self.task.id)
        self.recorded = [_item(r) for r in case["transcript"]]
        self.answers = _answers(self.recorded)
        self.compactions = [i for i in self.recorded if i.kind is ItemKind.COMPACTION]
        self.recorded_calls = {(int(c["turn"]), str(c["call_id"])): c for c in case["calls"]}
        self.items: list[Item] = []
        self.calls: list[CallView] = []
        self.state: dict[str, Any] = {}
        self.turn = 0
        self.version = 0
        self.phase = Phase.LOAD_CONTEXT
        #: calls whose divergence is reported: their results' differences later are its echo
        self.diverged_calls: set[str] = set()
        self.reported: set[tuple[str, str]] = set()
        #: the model calls so far are the recorded ones, one for one
        self.aligned = True
        self.model = RecordedModel(self)
        settings = case.get("settings") or {}
        self.max_result_bytes = int(settings.get("max_result_bytes") or 256 * 1024)
        self.deps = PhaseDeps(
            model_for=lambda spec: self.model,
            tools=tools,
            scheduler=_NoScheduler(),
            limits=PhaseLimits(
                dispatch_batch=int(settings.get("dispatch_batch") or 8),
                tool_deadline=float(settings.get("tool_deadline") or 300.0),
                human_deadline=float(settings.get("human_deadline") or 86400.0),
                context_tokens=settings.get("context_tokens"),
                context_tokens_by_model=dict(settings.get("context_tokens_by_model") or {}),
            ),
        )
        snapshots = {
            self.task.id: TaskSnapshot(
                self.task.id,
                TaskStatus.RUNNING,
                None,
                None,
                self.task.model,
                self.task.metadata,
                parent_id=self.task.parent_id,
                tools=self.task.tools,
            )
        }
        for child in case.get("children") or []:
            ct = child["task"]
            snapshots[ct["id"]] = TaskSnapshot(
                ct["id"],
                TaskStatus(ct.get("status") or "succeeded"),
                ct.get("result"),
                ct.get("error"),
                ct["model"],
                dict(ct.get("metadata") or {}),
                parent_id=ct.get("parent_id"),
                tools=ct.get("tools"),
            )
        self.children = _Children(snapshots)

    # -- what the model port asks ------------------------------------------------------------

    def take_compaction(self, turn: int) -> Item | None:
        for n, item in enumerate(self.compactions):
            if item.turn == turn:
                return self.compactions.pop(n)
        return None

    def skip_compactions(self, turn: int) -> bool:
        before = len(self.compactions)
        self.compactions = [i for i in self.compactions if i.turn != turn]
        return len(self.compactions) != before

    def diverge(
        self,
        turn: int | None,
        kind: str,
        recorded: Any,
        new: Any,
        how: str,
        *,
        call_id: str | None = None,
        tool: str | None = None,
    ) -> None:
        if self.capture:
            return
        self.report.divergences.append(
            Divergence(turn, call_id, tool, kind, recorded, new, how, self.task.id)
        )
        self.say(f"  ! {kind}{f' {call_id}' if call_id else ''}: {_indented(how)}")
        if call_id is not None:
            self.diverged_calls.add(call_id)

    def say(self, line: str) -> None:
        self.report.lines.append(line)

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> ReplayReport:
        self.say(f"task {self.task.id} (model {self.task.model}): {_short(self.task.prompt, 80)}")
        if any("copied_from" in i.payload for i in self.recorded):
            # a fork's run starts from items copied from another task's record, not from its
            # goal: replay the task it was forked from
            self.report.problems.append(
                f"task {self.task.id} is a fork; replay the task it was forked from"
            )
            return self.report
        if not self.capture:
            self._compare_tools()
        for _ in range(MAX_STEPS):
            if self.phase in (Phase.REPORT_TERMINAL, Phase.REPORT_FAILURE, Phase.DONE):
                self._ended()
                break
            try:
                if not self._step():
                    break
            except RecordEnds as exc:
                self.say(f"turn {self.turn}: {exc}; the replay ends here")
                break
            except Exception as exc:
                # what the worker's shell does with a phase that raises: the run fails here
                self._failed(exc)
                break
        else:
            self.report.problems.append(f"the replay did not end within {MAX_STEPS} steps")
        self._unreplayed()
        return self.report

    def _failed(self, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if any(turn >= self.turn for turn in self.answers):
            self.diverge(
                self.turn,
                "run_failed",
                None,
                error,
                f"today's code fails the run in {self.phase.value} at turn {self.turn} "
                f"({_short(error, 200)}); the record went on",
            )
        else:
            self.say(f"turn {self.turn}: the run fails ({_short(error, 200)}), as the record ends")

    def _unreplayed(self) -> None:
        """The record went on past where the replay ended (a final answer reopened by a
        message, which a replay does not play): what was not replayed is a problem."""
        later = sorted(turn for turn in self.answers if turn > self.turn)
        if later and self.phase in (Phase.REPORT_TERMINAL, Phase.DONE):
            self.report.problems.append(
                f"the record goes on to turn {later[-1]}; the replay ended at turn {self.turn}"
            )

    def _ended(self) -> None:
        final = next((i for i in reversed(self.items) if i.kind is ItemKind.FINAL), None)
        if final is not None:
            self.say(f"turn {self.turn}: final answer: {_short(final.payload.get('content'), 100)}")
        else:
            self.say(f"turn {self.turn}: the run ends ({self.phase.value})")

    def _view(self, messages: list[Message] | None = None) -> RunView:
        return RunView(
            execution_id=self.execution_id,
            phase=self.phase,
            version=self.version,
            turn=self.turn,
            state=dict(self.state),
            attempts=1,
            task=self.task,
            now=CLOCK,
            items=list(self.items),
            calls=[c for c in self.calls if c.turn == self.turn],
            messages=messages or [],
        )

    def _step(self) -> bool:
        phase = self.phase
        view = self._view()
        if phase is Phase.CALL_MODEL:
            plan = self._plan(view)
            asked = len(self.model.requests)
            transition = run_phase(view, self.deps)
            for request in self.model.requests[asked:]:
                self._captured(request, plan)
            self._answered(transition)
        else:
            transition = run_phase(view, self.deps)
            if phase in (Phase.LOAD_CONTEXT, Phase.ADVANCE_TURN):
                messages = self._messages_after(len(transition.items))
                if messages:
                    transition = run_phase(self._view(messages), self.deps)
        if transition.to is None and not transition.settle:
            self.say(f"turn {self.turn}: the run would wait here ({transition.note}); it ends")
            return False
        self._apply(transition)
        if phase is Phase.DISPATCH_TOOLS:
            return self._run_calls(transition)
        return True

    def _messages_after(self, written: int) -> list[Message]:
        """The people's messages the record took in right after this boundary's items."""
        found: list[Message] = []
        seq = len(self.items) + written
        by_seq = {i.seq: i for i in self.recorded}
        while (item := by_seq.get(seq)) is not None and (
            item.kind is ItemKind.INPUT and item.payload.get("message_id") is not None
        ):
            payload = item.payload
            found.append(
                Message(
                    seq,
                    str(payload.get("message_id")),
                    str(payload.get("content") or ""),
                    str(payload.get("sent_by") or ""),
                )
            )
            seq += 1
        return found

    def _plan(self, view: RunView) -> dict[str, Any]:
        """The context plan of this model call (what call_model plans, executor/context.py)."""
        # the tools call_model offers: those the run's planning recorded, of today's
        available = self.tools.enabled(self.task.tools)
        enabled = context.planned_tools(available, view.state, lambda t: t.name)
        window = context.window_for(self.task.model, self.deps.limits, view.state)
        try:
            plan = context.plan(
                view.items,
                view.turn,
                window,
                view.state,
                [t.spec() for t in enabled],
                recall=any(t.name == context.RECALL_TOOL for t in enabled),
            )
        except ModelError as exc:
            return {"error": str(exc)}
        return {
            "window": window.tokens if window else None,
            "elided": plan.elided,
            "cut": plan.cut,
            "summarises": list(plan.summary.covers) if plan.summary else None,
            "from_compaction": plan.compaction.payload.get("covers") if plan.compaction else None,
        }

    def _captured(self, request: ModelRequest, plan: dict[str, Any]) -> None:
        """Keep the input this model call was sent and compare it with the recorded one, at
        its turn (a replay that compacts where the record did not, or the other way round,
        compares no further: that is reported where it happened)."""
        sent = {
            "turn": request.turn,
            "purpose": request.purpose,
            "items": [render_item(i) for i in request.items],
            "tools": [t.name for t in request.tools],
            "plan": plan if request.purpose == "turn" else {},
        }
        n = len(self.report.model_calls)
        self.report.model_calls.append(sent)
        recorded = self.case["model_calls"]
        if self.capture or not self.aligned or n >= len(recorded):
            return
        old = recorded[n]
        if (old.get("turn"), old.get("purpose")) != (sent["turn"], sent["purpose"]):
            self.aligned = False
            return
        if request.purpose == "summary" and self.diverged_calls:
            # a summary's input renders the results it covers into one text: after a call
            # diverged, a difference there is that divergence's echo, reported already
            return
        self._compare_input(request.turn, old, sent)

    def _answered(self, transition: Transition) -> None:
        if any(i.kind is ItemKind.COMPACTION for i in transition.items):
            covers = transition.items[0].payload.get("covers")
            self.say(f"turn {self.turn}: compaction of items {covers} (summary from the record)")
            return
        calls = [i for i in transition.items if i.kind is ItemKind.TOOL_CALL]
        if calls:
            self.say(f"turn {self.turn}: the model called {len(calls)} tool(s) (recorded answer)")
        # today's plan_call may settle a call at birth the record ran: its tool is gone, or its
        # arguments no longer fit the schema
        for new in transition.calls:
            recorded = self.recorded_calls.get((self.turn, new.call_id))
            if new.settled is None or recorded is None:
                continue
            outcome, result = new.settled
            if recorded.get("outcome") == outcome.value and recorded.get("result") == result:
                continue
            definition = self.tools.get(new.name)
            enabled = definition is not None and (
                self.task.tools is None or new.name in self.task.tools
            )
            if not enabled:
                self.diverge(
                    self.turn,
                    "tool_gone",
                    recorded.get("result"),
                    result,
                    f"tool {new.name!r} is not registered today; the record called it",
                    call_id=new.call_id,
                    tool=new.name,
                )
            else:
                self.diverge(
                    self.turn,
                    "arguments_invalid",
                    new.arguments,
                    result,
                    f"the recorded arguments no longer validate against {new.name!r}'s schema: "
                    + _short(result.get("error") if isinstance(result, dict) else result, 200),
                    call_id=new.call_id,
                    tool=new.name,
                )

    def _apply(self, transition: Transition) -> None:
        seq = len(self.items)
        for new in transition.items:
            self.items.append(Item(seq, self.turn, new.kind, new.call_id, dict(new.payload)))
            seq += 1
        for call in transition.calls:
            settled = call.settled
            self.calls.append(
                CallView(
                    call.call_id,
                    self.turn,
                    call.index,
                    call.name,
                    call.arguments,
                    CallState.SETTLED if settled else CallState.PENDING,
                    settled[0] if settled else None,
                    settled[1] if settled else None,
                    None,
                    None,
                    CLOCK if settled else None,
                    None,
                    hold=call.hold,
                    hold_info=call.hold_info,
                )
            )
        queued = {call_id: deadline for call_id, deadline in transition.queue_calls}
        queued.update(dict(transition.ask_calls))
        for n, c in enumerate(self.calls):
            if c.turn == self.turn and c.call_id in queued:
                self.calls[n] = replace(c, queued_at=CLOCK, deadline_at=queued[c.call_id])
        for settlement in transition.settle:
            self._settle(settlement.call_id, settlement.outcome, settlement.result)
        if transition.state is not None:
            self.state = dict(transition.state)
        if transition.task_status is not None:
            self.task = replace(self.task, status=transition.task_status)
        if transition.next_turn:
            self.turn += 1
        if transition.to is not None:
            self.phase = transition.to
            self.version += 1

    def _settle(self, call_id: str, outcome: Outcome, result: Any) -> None:
        for n, c in enumerate(self.calls):
            if c.turn == self.turn and c.call_id == call_id:
                self.calls[n] = replace(
                    c, state=CallState.SETTLED, outcome=outcome, result=result, settled_at=CLOCK
                )

    # -- the turn's calls -------------------------------------------------------------------

    def _run_calls(self, transition: Transition) -> bool:
        """Settle the turn's open calls as the record says, running again what is safe to."""
        for call in [c for c in self.calls if c.turn == self.turn]:
            if call.state is CallState.SETTLED:
                continue
            recorded = self.recorded_calls.get((self.turn, call.call_id))
            if recorded is None or recorded.get("state") != CallState.SETTLED.value:
                self.say(
                    f"turn {self.turn}: call {call.call_id} ({call.name}) has no recorded result "
                    "(the recorded run ended before it settled); the replay ends here"
                )
                return False
            if call.hold is Hold.APPROVAL and call.queued_at is None:
                verdict = self._verdict(recorded)
                if recorded.get("outcome") == Outcome.DENIED.value:
                    self.say(f"  ↳ {call.call_id} {call.name}: denied ({verdict}, from the record)")
                    self._stand_in(call, recorded, quiet=True)
                    continue
                self.say(f"  ↳ {call.call_id} {call.name}: approved ({verdict}, from the record)")
            elif call.hold is Hold.REPLY:
                self.say(
                    f"  ↳ {call.call_id} {call.name}: a person's answer from the record: "
                    f"{_short(recorded.get('result'), 80)}"
                )
                self._stand_in(call, recorded, quiet=True)
                continue
            self._run_call(call, recorded)
        return True

    def _verdict(self, recorded: dict[str, Any]) -> str:
        call_id = recorded.get("call_id")
        for action in self.case.get("actions") or []:
            if action.get("call_id") == call_id and action.get("action") in ("approve", "deny"):
                return f"{action.get('action')} by {action.get('actor')}"
        return f"settled by {recorded.get('settled_by')}"

    def _stand_in(self, call: CallView, recorded: dict[str, Any], *, quiet: bool = False) -> None:
        outcome = Outcome(recorded.get("outcome") or Outcome.ERROR.value)
        if not quiet:
            self.say(
                f"  ↳ {call.call_id} {call.name}({_short(call.arguments, 60)}): "
                f"{recorded.get('effect')}, not run; its recorded {outcome.value} result "
                "stands in"
            )
        self._settle(call.call_id, outcome, recorded.get("result"))

    def _run_call(self, call: CallView, recorded: dict[str, Any]) -> None:
        definition = self.tools.get(call.name)
        recorded_effect = str(recorded.get("effect") or "")
        recorded_outcome = str(recorded.get("outcome") or "")
        if definition is None:
            self._stand_in(call, recorded)
            return
        if definition.effect.value != recorded_effect:
            self.diverge(
                self.turn,
                "tool_schema",
                recorded_effect,
                definition.effect.value,
                f"tool {call.name!r} was a {recorded_effect} and is a "
                f"{definition.effect.value} today; it is not run (its recorded result stands in)",
                call_id=call.call_id,
                tool=call.name,
            )
            self._stand_in(call, recorded, quiet=True)
            return
        if definition.remote:
            # I35: the deployment is never touched. Its devbox or MCP server would be called
            # with the original task's identity (a devbox tool computes the task's own
            # workspace and creates it), not the scratch workspace: the record answers.
            self.say(
                f"  ↳ {call.call_id} {call.name}({_short(call.arguments, 60)}): runs against "
                f"the deployment's {definition.remote}: not run, its recorded "
                f"{recorded_outcome or Outcome.ERROR.value} result stands in"
            )
            self._stand_in(call, recorded, quiet=True)
            return
        reads = recorded_effect == Effect.READ.value
        # An outcome of the original run's circumstances (a deadline, a crash, a cancel), not
        # of its code, is not a result to compare: it stands in.
        comparable = recorded_outcome in (Outcome.OK.value, Outcome.ERROR.value)
        if self.capture or not comparable or not (reads or self.run_writes):
            self._stand_in(call, recorded)
            return
        outcome, result = self._invoke(call)
        if outcome is None:
            self.say(
                f"  ↳ {call.call_id} {call.name}: waits today as it did; its recorded result "
                "stands in"
            )
            self._stand_in(call, recorded, quiet=True)
            return
        kind = "read_result" if reads else "write_result"
        same = outcome.value == recorded_outcome and result == recorded.get("result")
        self.say(
            f"  ↳ {call.call_id} {call.name}({_short(call.arguments, 60)}): "
            f"{'read' if reads else 'write (--run-writes, in the scratch workspace)'} run "
            f"again: {'same result' if same else 'DIFFERENT result'}"
        )
        if not same:
            recorded_value = {"outcome": recorded_outcome, "result": recorded.get("result")}
            new_value = {"outcome": outcome.value, "result": result}
            self.diverge(
                self.turn,
                kind,
                recorded_value,
                new_value,
                f"{call.name!r} returns something else today:\n"
                + bounded_diff(recorded_value, new_value),
                call_id=call.call_id,
                tool=call.name,
            )
        # The same value settles as recorded: the record holds it as its store returned it
        # (PostgreSQL's jsonb orders an object's keys), and that is what the model was shown.
        self._settle(call.call_id, outcome, recorded.get("result") if same else result)

    def _invoke(self, call: CallView) -> tuple[Outcome | None, Any]:
        """Call today's handler, as a worker would (charlie.testing.ToolEnvironment's way),
        in the scratch workspace; None: it would wait (a Pending, a question)."""
        definition = self.tools.get(call.name)
        assert definition is not None and not definition.remote  # I35: see _run_call
        ctx = ToolContext(
            task_id=self.task.id,
            execution_id=self.execution_id,
            call_id=call.call_id,
            turn=self.turn,
            workspace=self.workspace,
            metadata=self.task.metadata,
            resumed=False,
            handle=None,
            _record_handle=lambda handle: None,
            children=self.children,
            record=_Record(self.items),
        )
        outcome, result = run_handler(definition, call.arguments, ctx)
        if isinstance(result, Pending | AskPerson):
            return None, None
        return outcome, cap_result(result, self.max_result_bytes)

    # -- comparing what the model is sent -------------------------------------------------------

    def _compare_tools(self) -> None:
        recorded: dict[str, Any] = self.case.get("tools") or {}
        today = {t.name: t for t in self.tools.enabled(self.task.tools)}
        called = {str(c.get("name")) for c in self.case["calls"]}
        for name, spec in sorted(recorded.items()):
            now = today.get(name)
            if now is None:
                if name in called:
                    continue  # reported where the record calls it (tool_gone)
                self.diverge(
                    0,
                    "tool_schema",
                    spec,
                    None,
                    f"tool {name!r} is no longer sent to the model",
                    tool=name,
                )
                continue
            mine = {"description": now.description, "parameters": now.parameters}
            theirs = {"description": spec.get("description"), "parameters": spec.get("parameters")}
            if mine != theirs:
                self.diverge(
                    0,
                    "tool_schema",
                    theirs,
                    mine,
                    f"tool {name!r}'s schema differs:\n" + bounded_diff(theirs, mine),
                    tool=name,
                )
        for name in sorted(set(today) - set(recorded)):
            self.diverge(
                0,
                "tool_schema",
                None,
                {"description": today[name].description, "parameters": today[name].parameters},
                f"tool {name!r} is sent to the model today; the record did not have it",
                tool=name,
            )

    def _compare_input(self, turn: int, old: dict[str, Any], new: dict[str, Any]) -> None:
        if old.get("plan") != new.get("plan"):
            self.diverge(
                turn,
                "context_plan",
                old.get("plan"),
                new.get("plan"),
                f"the context plan of turn {turn} differs: "
                + _describe_plan(old.get("plan") or {}, new.get("plan") or {}),
            )
        old_items: list[dict[str, Any]] = list(old.get("items") or [])
        new_items: list[dict[str, Any]] = list(new.get("items") or [])
        if len(old_items) != len(new_items) and ("input", "count") not in self.reported:
            self.reported.add(("input", "count"))
            self.diverge(
                turn,
                "input",
                len(old_items),
                len(new_items),
                f"the input of turn {turn} has {len(new_items)} items today, "
                f"{len(old_items)} recorded",
            )
        # items by their place in the transcript (an elided or summarised input keeps it)
        today = {(b.get("seq"), b.get("kind")): b for b in new_items}
        for a in old_items:
            b = today.get((a.get("seq"), a.get("kind")))
            if b is not None and a != b:
                self._item_differs(turn, a, b)

    def _item_differs(self, turn: int, a: dict[str, Any], b: dict[str, Any]) -> None:
        call_id = a.get("call_id")
        if a.get("kind") == "input" and a.get("role") == "system":
            kind, key = "system_prompt", "system"
            how = f"the system prompt differs (from turn {turn} on: it is sent with every turn)"
        elif a.get("kind") == "tool_result" and call_id is not None:
            if call_id in self.diverged_calls:
                return  # the echo of the call's own divergence
            kind, key = "rendering", f"result:{call_id}"
            how = f"the rendering of {call_id}'s result differs in the input of turn {turn}"
        else:
            kind, key = "input", f"item:{a.get('seq')}"
            how = f"input item {a.get('seq')} ({a.get('kind')}) differs in the input of turn {turn}"
        if (kind, key) in self.reported:
            return
        self.reported.add((kind, key))
        recorded_text, new_text = a.get("text"), b.get("text")
        self.report.divergences.append(
            Divergence(
                turn,
                call_id,
                None,
                kind,
                recorded_text,
                new_text,
                how + ":\n" + bounded_diff(recorded_text, new_text),
                self.task.id,
            )
        )
        if call_id is not None:
            self.diverged_calls.add(call_id)
        self.say(f"  ! {kind}{f' {call_id}' if call_id else ''}: {_indented(how)}")


def _indented(text: str) -> str:
    return text.replace("\n", "\n      ")


def _describe_plan(old: dict[str, Any], new: dict[str, Any]) -> str:
    parts = [
        f"{key} {old.get(key)!r} recorded, {new.get(key)!r} today"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    return "; ".join(parts)


class _NoScheduler:
    """The phases' SchedulerPort: a replay never reaches a report phase (it stops there)."""

    def finish(
        self, task_id: str, status: TaskStatus, *, result: Any = None, error: Any = None
    ) -> bool:
        return False


@contextmanager
def scratch_workspace(source: Path | None) -> Iterator[Path]:
    """A directory of its own for the replayed calls: a copy of ``source`` (never ``source``
    itself), or an empty one; removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="charlie-replay-"))
    try:
        workspace = base / "workspace"
        if source is not None:
            if not source.is_dir():
                raise CaseError(f"--workspace {source} is not a directory")
            shutil.copytree(source, workspace, symlinks=True)
        else:
            workspace.mkdir()
        yield workspace
    finally:
        shutil.rmtree(base, ignore_errors=True)


def replay_case(
    case: dict[str, Any],
    *,
    tools: ToolRegistry | None = None,
    workspace: Path | None = None,
    run_writes: bool = False,
    capture: bool = False,
) -> ReplayReport:
    """Replay ``case`` (checked by charlie.replay.case.check_case) and its delegated children
    with today's code: ``tools`` (the process's registry by default), reads and (with
    ``run_writes``) writes run in a scratch copy of ``workspace``. ``capture``: run nothing,
    every call standing in, to record the inputs the code sends (what an export does)."""
    registry = tools if tools is not None else REGISTRY
    with scratch_workspace(workspace) as scratch:
        report = _Replay(case, registry, scratch, run_writes=run_writes, capture=capture).run()
    for child in case.get("children") or []:
        report.children.append(
            replay_case(
                child, tools=registry, workspace=workspace, run_writes=run_writes, capture=capture
            )
        )
    return report
