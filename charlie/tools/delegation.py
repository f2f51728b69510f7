"""Delegation: ``delegate`` starts one child task; ``wait_for_task`` is the resumable wait on it.

The child's id is derived from the parent task and the delegating call, so a delegate call run
again (or reconciled) after a crash finds the same child instead of starting a second (I19).
The wait parks between observations instead of holding a worker process, and the child pokes
its waiters when it finishes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Sequence

from charlie.config import settings
from charlie.domain import JSON, MAX_TASK_ID, Outcome
from charlie.models import normalise_model
from charlie.tools.context import Pending, Reconciled, TaskSnapshot, ToolContext, ToolError
from charlie.tools.registry import tool

TASK_ID_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")

POLL_SECONDS = 2.0


def model_allowed(spec: str, patterns: Sequence[str]) -> bool:
    """Whether the operator's CHARLIE_DELEGATE_MODELS (names or glob patterns, ``*`` for any)
    lets a child use ``spec``."""
    return any(fnmatch.fnmatchcase(spec, pattern) for pattern in patterns)


def child_limits(
    parent: TaskSnapshot,
    tools: list[str] | None,
    model: str | None,
    allowed_models: Sequence[str],
) -> tuple[list[str] | None, str]:
    """The tools and model of a child of ``parent``: never more than the parent may use.

    ``tools`` None means the parent's tools (None for a parent that may use every tool); a
    list must name only tools the parent may use. ``model`` None means the parent's model;
    another model only when the operator allows it (``allowed_models``, CHARLIE_DELEGATE_MODELS).
    A widening is a ToolError the model sees, naming what was refused and what is allowed
    (I15); nothing is created."""
    if tools is None:
        child_tools = None if parent.tools is None else list(parent.tools)
    else:
        if parent.tools is not None:
            refused = [t for t in tools if t not in parent.tools]
            if refused:
                allowed = ", ".join(parent.tools) or "none"
                raise ToolError(
                    f"cannot delegate: tool(s) {', '.join(refused)} are not available to this "
                    f"task, so not to its child; a child may use only this task's tools: {allowed}",
                    refused_tools=refused,
                    allowed_tools=list(parent.tools),
                )
        child_tools = list(dict.fromkeys(tools))
    if model is None or model == parent.model:
        return child_tools, parent.model
    provider = model.partition(":")[0].strip()
    if provider == "scripted" and not parent.model.startswith("scripted:"):
        # A script sleeps, writes its ledger and reads files where it is told: a test harness,
        # never a model's to choose. Refused before its path is looked at, so the refusal
        # says nothing about what is there.
        raise ToolError(
            f"cannot delegate to model {model!r}: a scripted model is for tests; a child may "
            f"use one only when its parent runs on one (this task runs on {parent.model}), "
            "whatever CHARLIE_DELEGATE_MODELS allows",
            refused_model=model,
        )
    try:
        spec: str | None = normalise_model(model)
        problem = None
    except ValueError as exc:
        spec, problem = None, exc
    if spec != parent.model and not model_allowed(spec or model, allowed_models):
        others = f"; the operator also allows {', '.join(allowed_models)}" if allowed_models else ""
        raise ToolError(
            f"cannot delegate to model {model!r}: a child uses this task's model "
            f"({parent.model}) unless the operator allows others (CHARLIE_DELEGATE_MODELS)"
            f"{others}",
            refused_model=model,
            allowed_models=[parent.model, *allowed_models],
        )
    if spec is None:
        raise ToolError(f"cannot delegate: {problem}")
    return child_tools, spec


def child_task_id(ctx: ToolContext) -> str:
    """``<parent>.<turn>.<call id>``: deterministic, so a repeated delegate finds the same child;
    hashed when that would be too long, never truncated into a collision."""
    child = f"{ctx.task_id}.{ctx.turn}.{ctx.call_id}"
    if len(child) <= MAX_TASK_ID and TASK_ID_CHARS.match(child):
        return child
    digest = hashlib.sha256(child.encode()).hexdigest()[:24]
    return f"{ctx.task_id[: MAX_TASK_ID - 26]}.{digest}"


def _finish_delegation(
    prompt: str, ctx: ToolContext, model: str | None = None, tools: list[str] | None = None
) -> Reconciled:
    """Recovery for a delegate call whose worker died: finish the delegation.

    Submitting the child again cannot start a second one, since its id is derived from this call
    and a submit of an existing id returns that task, even once the parent has stopped (I19).
    So what a read-back would find
    ("created" or "not yet") and what doing it again does are the same, and the model gets the
    delegation it asked for rather than an error that a crash happened."""
    try:
        return Reconciled(Outcome.OK, delegate(prompt, ctx, model=model, tools=tools))
    except ToolError as exc:
        return Reconciled(Outcome.ERROR, exc.as_result())


@tool(effect="write", deadline=60, reconcile=_finish_delegation, threadsafe=True)
def delegate(
    prompt: str, ctx: ToolContext, model: str | None = None, tools: list[str] | None = None
) -> JSON:
    """Start a child task for a narrow, self-contained piece of work and return its task id.

    Wait for its result with wait_for_task. The child works in the same workspace, with this
    task's tools unless ``tools`` names fewer of them, and with this task's model unless
    ``model`` names another the operator allows."""
    # Imported here: the devbox tools replace built-ins, so they load after them (tools/__init__).
    from charlie.tools.devbox_tools import inherited_devbox

    parent = ctx.children.get(ctx.task_id)
    if parent is None:
        raise ToolError(f"parent task {ctx.task_id} is gone")
    child_tools, spec = child_limits(parent, tools, model, settings().delegate_models)
    metadata: JSON = {"delegated_by": {"task_id": ctx.task_id, "call_id": ctx.call_id}}
    if "workspace" in parent.metadata:
        metadata["workspace"] = parent.metadata["workspace"]
    # The child works in the parent's devbox workspace (its id spelled out, not re-derived).
    devbox = inherited_devbox(ctx, parent.metadata)
    if devbox is not None:
        metadata["devbox"] = devbox
    # The port refuses unknown tools and a stopped parent (a ToolError), and starts the child's
    # run when it created it.
    submitted = ctx.children.submit(
        prompt=prompt,
        model=spec,
        tools=child_tools,
        task_id=child_task_id(ctx),
        metadata=metadata,
        parent_id=ctx.task_id,
        parent_call_id=ctx.call_id,
    )
    return {"task_id": submitted.task_id, "created": submitted.created}


@tool(effect="wait", resumable=True, deadline=3600, threadsafe=True)
def wait_for_task(task_id: str, ctx: ToolContext) -> JSON | Pending:
    """Wait for a task this task delegated (a child started with delegate) to finish and
    return its result."""
    info = ctx.children.get(task_id)
    if info is None or info.parent_id != ctx.task_id:
        # One answer for "no such task" and "someone else's": neither says which; another
        # task's result is not this task's to read.
        raise ToolError(
            f"task {task_id!r} is not a child of this task: wait_for_task waits only for "
            "tasks this task started with delegate"
        )
    if ctx.handle is None:
        # Durable before anything else: a resumed wait observes this same task (I19).
        ctx.record_handle(task_id)
    if not info.terminal:
        return Pending(handle=task_id, poll_after=POLL_SECONDS)
    outcome = {
        "task_id": task_id,
        "status": info.status.value,
        "result": info.result,
        "task_error": info.error,
    }
    if info.status.value != "succeeded":
        raise ToolError(f"task {task_id} ended {info.status.value}", **outcome)
    return outcome
