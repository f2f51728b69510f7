"""call_model: ask the model for the next turn and persist what it returned.

The call runs outside any transaction (I5); its output is committed before anything acts on it,
so a crash before the commit repeats only this call (I3), and the repeat is counted.

While the model writes, a streaming client sends what it writes to the run's event stream for
people watching (``deps.events``, charlie/streams); no phase reads it back (I28). Each attempt is
a stream of its own, named ``turn.version.attempt``: a repeat after a crash first marks the
attempt before it abandoned, then streams again from the start; the answer is only what
``complete`` returns, committed once (I16).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from charlie import faults
from charlie.domain import (
    Effect,
    Hold,
    ItemKind,
    NewCall,
    NewItem,
    Outcome,
    Phase,
    RunView,
    TaskStatus,
    Transition,
)
from charlie.executor import context
from charlie.models import inflight, retrying
from charlie.models.base import ModelError, ModelRequest, ModelResponse, TransientModelError
from charlie.ports import CapacitySlot, CapacityWait, PhaseDeps
from charlie.tools.registry import ToolDef, ToolRegistry

#: what a run's state holds only while its model call is retried or waits for capacity
_CALL_STATE = (
    "model_retries",
    "last_model_error",
    "capacity",
    "model_attempts",
    retrying.STATE_KEY,
)
#: the attempts of this (turn, version)'s call before its last wait (a capacity wait, a
#: transient failure's retry), which ends with its attempt count reset: how many there were
#: (their streams' names are taken) and the repeats after a crash among them (I3)
_ATTEMPTS = "model_attempts"

#: messages: its boundary takes in any that wait before the model is called (I22, boundary.
#: take_mail); read only when the claim counts some, so a steady turn reads no mailbox
NEEDS = frozenset({"items", "messages"})


def _unique_call_id(call_id: str, seen: set[str]) -> str:
    candidate, n = call_id, 1
    while candidate in seen:
        n += 1
        candidate = f"{call_id}#{n}"
    seen.add(candidate)
    return candidate


def plan_call(
    index: int,
    item: NewItem,
    allowed: list[str] | None,
    tools: ToolRegistry,
    approve: list[str] | None = None,
) -> NewCall:
    """A model's tool call as a pending-tool record; one that can never run is born settled
    with an error result, so it still gets exactly one result (I8, I15). A call of a tool that
    needs approval (the tool's ``approval=True``, or the task's ``approve`` list) is born held
    for a person's verdict, and so is a question to a person (I23)."""
    assert item.call_id is not None
    name = str(item.payload.get("name"))
    arguments = item.payload.get("arguments")
    definition = tools.get(name)

    def failed(message: str) -> NewCall:
        return NewCall(
            item.call_id or "",
            index,
            name,
            arguments or {},
            effect=definition.effect if definition else Effect.READ,
            resumable=False,
            settled=(Outcome.ERROR, {"error": message}),
        )

    if definition is None or (allowed is not None and name not in allowed):
        available = ", ".join(t.name for t in tools.enabled(allowed)) or "none"
        return failed(f"unknown tool {name!r}; the tools available are: {available}")
    if arguments is None:
        raw = str(item.payload.get("raw_arguments", ""))[:500]
        return failed(f"the arguments for {name!r} are not a JSON object: {raw!r}")
    problem = definition.validate(arguments)
    if problem:
        return failed(problem)
    hold, info = None, None
    if definition.answered_by_person:
        hold, info = Hold.REPLY, {"question": arguments.get("question")}
    elif definition.approval or (approve is not None and name in approve):
        hold = Hold.APPROVAL
        info = {
            "why": "the tool needs approval" if definition.approval else "the task's approve list",
            # what an approve dispatches it with (the producer may not have the tool itself)
            "deadline_seconds": definition.deadline,
        }
    return NewCall(
        item.call_id,
        index,
        name,
        arguments,
        definition.effect,
        resumable=definition.resumable,
        hold=hold,
        hold_info=info,
        on_interrupt=definition.on_interrupt,
    )


def run(view: RunView, deps: PhaseDeps) -> Transition:
    """The model call, planned with the settings the run recorded; each commit records this
    worker's for the next call (``context.settings``, I29)."""
    available = deps.tools.enabled(view.task.tools)
    mine = context.settings(view.task.model, deps.limits, [t.name for t in available])
    moved = _run(view, deps, context.planned_tools(available, view.state, lambda t: t.name))
    if moved.state is not None and isinstance(moved.state.get(context.STATE_KEY), dict):
        moved = replace(moved, state=context.with_settings(moved.state, mine))
    return moved


def _run(view: RunView, deps: PhaseDeps, enabled: list[ToolDef]) -> Transition:
    task = view.task
    model = deps.model_for(task.model)
    tools = [t.spec() for t in enabled]
    retries = int(view.state.get("model_retries", 0))
    # The input under the model's window (I29): the transcript, elided or summarised.
    window = context.window_for(task.model, deps.limits, view.state)
    recall = any(t.name == context.RECALL_TOOL for t in enabled)
    plan = context.plan(
        view.items,
        view.turn,
        window,
        view.state,
        tools,
        recall=recall,
        compaction_known=view.compaction_known,
    )
    if plan.summary is not None:
        return _compact(view, deps, plan, retries)
    request = ModelRequest(
        task_id=task.id,
        execution_id=view.execution_id,
        turn=view.turn,
        items=plan.items,
        tools=tools,
    )
    attempt = _attempts_before(view)[0] + view.attempts
    stream = deps.events.model_stream(task.id, view.turn, f"{view.turn}.{view.version}.{attempt}")
    if view.attempts > 1 and deps.events.enabled:
        # I3: the attempt before this one lost its worker before its answer committed
        deps.events.emit(
            task.id,
            "model_end",
            turn=view.turn,
            call=f"{view.turn}.{view.version}.{attempt - 1}",
            status="abandoned",
            reason="its worker stopped before the answer was recorded; the call is repeated",
        )
    # A provider limit the fleet keeps may hold the call back: the run waits with a stored
    # wake-up, holding no worker and no lease (I30); no limit, no statement.
    taken = _take_slot(view, deps, request)
    if isinstance(taken, Transition):
        return taken
    request, slot = taken
    if deps.events.enabled:
        stream.start(model=task.model, attempt=attempt, retry=retries)
        request = replace(request, deltas=stream)
    try:
        with inflight.counted():
            response = model.complete(request)
    except BaseException as exc:
        deps.capacity.release(slot, None)
        stream.end("abandoned", f"{type(exc).__name__}: {exc}")
        refused = context.refusal(exc)
        if refused is not None:
            assert isinstance(exc, Exception)
            return context.learn(view.state, plan, refused, task.model, exc)
        if not isinstance(exc, TransientModelError):
            raise
        return _retry_later(view, deps, task.model, retries, exc)
    deps.capacity.release(slot, response.usage)
    stream.end("completed")
    return _transition(view, deps, response, context.after_call(plan, response.usage))


def _compact(view: RunView, deps: PhaseDeps, plan: context.Plan, retries: int) -> Transition:
    """The input does not fit: summarise older turns first, in a step of its own (I29)."""
    assert plan.summary is not None
    task = view.task
    request = context.summary_request(task.id, view.execution_id, view.turn, plan.summary)
    # A summary is a request like any other under the provider's limits (I30).
    taken = _take_slot(view, deps, request)
    if isinstance(taken, Transition):
        return taken
    request, slot = taken
    try:
        with inflight.counted():
            response = deps.model_for(task.model).complete(request)
    except TransientModelError as exc:
        deps.capacity.release(slot, None)
        return _retry_later(view, deps, task.model, retries, exc)
    except ModelError as exc:
        deps.capacity.release(slot, None)
        refused = context.refusal(exc)
        if refused is None:
            raise
        return context.learn(view.state, plan, refused, task.model, exc)
    except BaseException:
        deps.capacity.release(slot, None)
        raise
    deps.capacity.release(slot, response.usage)
    faults.hit("call_model.summarised", task_id=task.id, turn=view.turn)
    # (the attempts whose count is its repeats: this claim's, and those before its waits)
    return context.compacted(view.state, plan, response, task.model, 1 + _repeats(view))


def _take_slot(
    view: RunView, deps: PhaseDeps, request: ModelRequest
) -> tuple[ModelRequest, CapacitySlot | None] | Transition:
    """A slot under the model's provider limit for ``request`` (None: no limit), with the
    request told how to pause the whole limit on a 429; or, over the limit, the run's wait."""
    slot = deps.capacity.acquire(view, view.task.model, request)
    if isinstance(slot, CapacityWait):
        return _wait_for_capacity(view, slot)
    if slot is not None:
        held = slot
        request = replace(request, throttled=lambda s: deps.capacity.throttled(held, s))
    return request, slot


def _attempts_before(view: RunView) -> tuple[int, int]:
    """The attempts of this call before its last wait, and the repeats among them."""
    carried = view.state.get(_ATTEMPTS)
    if isinstance(carried, dict) and carried.get("version") == view.version:
        return int(carried.get("attempts", 0)), int(carried.get("repeats", 0))
    return 0, 0


def _repeats(view: RunView) -> int:
    """The call's repeats after a crash (I3): this claim's attempts beyond its first, and
    those counted before its waits (a wait resets the claim's count)."""
    return _attempts_before(view)[1] + max(0, view.attempts - 1)


def _carried(view: RunView) -> dict[str, int]:
    """What a wait of this call keeps of its attempts (``_ATTEMPTS``), for the next to see."""
    attempts, _ = _attempts_before(view)
    return {
        "version": view.version,
        "attempts": attempts + view.attempts,
        "repeats": _repeats(view),
    }


def _wait_for_capacity(view: RunView, wait: CapacityWait) -> Transition:
    """Wait as a stored wake-up (the sweep, or the release of a slot, publishes the tick
    again), never in a tick; the wait is not a failed attempt of the model."""
    capacity = {
        "limit": wait.limit,
        "reason": wait.reason,
        "in_flight": wait.in_flight,
        "waiting": wait.waiting,
        "until": wait.until.isoformat(),
    }
    return Transition(
        to=None,
        state={**view.state, "capacity": capacity, _ATTEMPTS: _carried(view)},
        wake_at=wait.until,
        publish_next=False,
        note=wait.describe(),
    )


def _retry_later(
    view: RunView, deps: PhaseDeps, model: str, retries: int, exc: TransientModelError
) -> Transition:
    """Ask again later, as a stored wake-up for the sweep (never slept in a tick), while the
    retry stays within its bound (I36): ``model_retry_seconds`` from the first failure. What
    the run waits for (the last error, the attempts, the next attempt's time, the bound) is in
    its state for status, list, watch, the console and doctor (charlie/models/retrying.py)."""
    retry = retrying.from_state(view.state)
    since = retry.since if retry is not None else view.now
    attempts = (retry.attempts if retry is not None else 0) + retrying.attempts_in(exc)
    delay = exc.retry_after if exc.retry_after is not None else min(60.0, 2.0**retries)
    bound = deps.limits.model_retry_seconds
    elapsed = (view.now - since).total_seconds()
    if elapsed + delay > bound or retries + 1 >= deps.limits.model_retries:
        raise ModelError(
            retrying.gave_up(model, attempts, elapsed, bound, str(exc)),
            evidence=exc.evidence,
        ) from exc
    next_at = view.now + timedelta(seconds=delay)
    wait = retrying.Wait(
        worker=deps.worker,
        turn=view.turn,
        began=view.now,
        failed_at=max(deps.clock(), view.now),
        next_at=next_at,
        attempts=attempts,
        error=str(exc),
        first=(retry.attempts if retry is not None else 0) + 1,
    )
    earlier = retry.waits if retry is not None else ()
    state = {
        **{k: v for k, v in view.state.items() if k != "capacity"},
        "model_retries": retries + 1,
        "last_model_error": str(exc),
        retrying.STATE_KEY: retrying.Retrying(
            error=str(exc),
            attempts=attempts,
            since=since,
            next_at=next_at,
            bound=bound,
            waits=(*earlier, wait)[-retrying.KEPT_WAITS :],
        ).as_state(),
        _ATTEMPTS: _carried(view),
    }
    if deps.events.enabled:
        # what a watcher sees of it (I36); the stream is a view, never read back (I28)
        deps.events.emit(
            view.task.id,
            "retrying",
            turn=view.turn,
            error=str(exc),
            attempts=attempts,
            next_at=next_at.isoformat(),
            until=(since + timedelta(seconds=bound)).isoformat(),
        )
    return Transition(
        to=None,
        state=state,
        wake_at=next_at,
        publish_next=False,
        note=f"retrying the model call: {retrying.attempts_failed(attempts)}; next attempt "
        f"in {delay:.1f} s",
    )


def _transition(
    view: RunView, deps: PhaseDeps, response: ModelResponse, window_state: dict[str, object]
) -> Transition:
    task = view.task
    items: list[NewItem] = []
    calls: list[NewCall] = []
    seen: set[str] = set()
    for item in response.output:
        if item.kind is ItemKind.TOOL_CALL:
            call_id = _unique_call_id(item.call_id or f"call_{len(calls)}", seen)
            item = NewItem(item.kind, item.payload, call_id=call_id)
            calls.append(plan_call(len(calls), item, task.tools, deps.tools, task.approve))
        items.append(item)

    state = {k: v for k, v in view.state.items() if k not in _CALL_STATE}
    # always: the settings the next call plans with ride in it (run)
    state[context.STATE_KEY] = window_state
    usage = response.usage.as_dict()
    repeats = _repeats(view)
    # A fork starts at this phase, its task still queued: its first model call starts it.
    started = TaskStatus.RUNNING if task.status is TaskStatus.QUEUED else None
    if calls:
        # A call held for a person is held from this commit on, so the task waits from it too
        # (get_task().waiting_for lists it), not from the dispatch tick, which may come late.
        held = any(c.hold is not None for c in calls) and task.status is not TaskStatus.WAITING
        return Transition(
            to=Phase.DISPATCH_TOOLS,
            state=state,
            items=items,
            calls=calls,
            model_calls=1,
            model_repeats=repeats,
            usage=usage,
            task_status=TaskStatus.WAITING if held else started,
        )
    # The final answer: its last message becomes the durable final item (I16).
    messages = [i for i in items if i.kind is ItemKind.MESSAGE]
    final_text = str(messages[-1].payload.get("content", "")) if messages else ""
    if messages:
        items.remove(messages[-1])
    items.append(NewItem(ItemKind.FINAL, {"content": final_text}))
    return Transition(
        to=Phase.REPORT_TERMINAL,
        state=state,
        items=items,
        model_calls=1,
        model_repeats=repeats,
        usage=usage,
        task_status=started,
    )
