"""``charlie export``: a task's record as a self-contained case file (I35).

The record is read through the API (get_task, transcript, calls, actions, run_record), with
its delegated children, each in a case of its own nested in its parent's. The inputs the
model was sent are then computed from that record by the replay driver itself, every call
standing in (charlie.replay.engine, ``capture``): the model input is a pure function of the
transcript and the run's context state (executor/context.py), so the exporting process's code
gives the input the workers' code sent, provided it is the code that ran the task.

Secrets never go in (charlie.replay.case.Scrubber): the environment is not exported, and the
values of its secrets, wherever a prompt, a result or an argument quotes them, are blanked.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from charlie import api
from charlie.config import settings
from charlie.models.retry import env_name
from charlie.replay.case import FORMAT, FORMAT_VERSION, Scrubber, check_case, environment_secrets
from charlie.replay.engine import replay_case
from charlie.runtime import import_tool_modules
from charlie.tools.registry import REGISTRY, ToolRegistry

#: how deep a delegation tree is exported (a child's children, and so on)
MAX_DEPTH = 8
#: at most this many children of one task
MAX_CHILDREN = 1000


def _charlie_version() -> str:
    try:
        return version("charlie")
    except PackageNotFoundError:
        return "unknown"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


#: the metadata key and the model spec's mark of a task a Pydantic AI agent runs (charlie/agents)
AGENT_KEY = "charlie.agent"
AGENT_MARK = "#agent="


def _agent_of(metadata: Any, model: str) -> dict[str, Any] | None:
    """What names the agent of an agent task (its metadata entry, the model spec's agent part);
    None for a native task. Such a task is exported with its own kind, which this version's
    replay refuses rather than replay it as a native task."""
    found = metadata.get(AGENT_KEY) if isinstance(metadata, dict) else None
    if found is None and AGENT_MARK not in model:
        return None
    return {"metadata": found, "model": model}


def _task_record(task_id: str, tools: ToolRegistry, depth: int) -> dict[str, Any]:
    info = api.get_task(task_id)
    run = api.run_record(task_id)
    s = settings()
    model_name = env_name(info.model.partition(":")[2] or info.model)
    own_window = s.context_tokens_by_model.get(model_name)
    enabled = tools.enabled(run["tools"])
    agent = _agent_of(info.metadata, info.model)
    record: dict[str, Any] = {
        "task": {
            "id": info.id,
            "kind": "native" if agent is None else "pydantic_ai",
            "prompt": info.prompt,
            "model": info.model,
            "tools": run["tools"],
            "approve": run["approve"],
            "metadata": info.metadata,
            "parent_id": info.parent_id,
            "status": info.status.value,
            "result": info.result,
            "error": info.error,
            "budget": info.budget,
            "created_at": _iso(info.created_at),
            "finished_at": _iso(info.finished_at),
            "turn": info.turn,
            "model_calls": info.model_calls,
            "usage": info.usage,
        },
        # what shaped the model's input and the turn's dispatch (executor/context.py, phases)
        "settings": {
            "context_tokens": s.model_context_tokens,
            "context_tokens_by_model": {model_name: own_window} if own_window else {},
            "dispatch_batch": s.dispatch_batch,
            "tool_deadline": s.tool_deadline,
            "human_deadline": s.human_deadline,
            "max_result_bytes": s.max_result_bytes,
        },
        "context_state": run["context"],
        "tools": {
            t.name: {
                "description": t.description,
                "parameters": t.parameters,
                "effect": t.effect.value,
                "implementation": t.implementation,
            }
            for t in enabled
        },
        "transcript": [
            {
                "seq": e.seq,
                "turn": e.turn,
                "kind": e.kind,
                "call_id": e.call_id,
                "payload": e.payload,
            }
            for e in api.transcript(task_id)
        ],
        "calls": [
            {
                "call_id": c.call_id,
                "turn": c.turn,
                "index": c.index,
                "name": c.name,
                "arguments": c.arguments,
                "effect": c.effect,
                "state": c.state,
                "outcome": c.outcome,
                "result": c.result,
                "settled_by": c.settled_by,
                "attempts": c.attempts,
                "handle": c.handle,
                "hold": c.hold,
                "hold_info": c.hold_info,
                "late_result": c.late_result,
                "duration_ms": c.duration_ms,
            }
            for c in api.calls(task_id)
        ],
        "actions": [
            {
                "action": getattr(a.action, "value", str(a.action)),
                "call_id": a.call_id,
                "turn": a.turn,
                "actor": a.actor,
                "at": _iso(a.at),
                "note": a.note,
                "detail": a.detail,
            }
            for a in api.actions(task_id)
        ],
        "children": [],
    }
    if agent is not None:
        record["agent"] = agent
    if depth < MAX_DEPTH:
        children = api.list_tasks(parent=task_id, limit=MAX_CHILDREN)
        record["children"] = [
            _task_record(child.id, tools, depth + 1)
            for child in sorted(children, key=lambda c: (c.created_at, c.id))
        ]
    return record


def _capture(record: dict[str, Any], tools: ToolRegistry) -> None:
    """The inputs the model was sent, from the record, for the task and each child (an agent
    task's are its framework's to make: none are computed for it)."""
    if _has_agents(record):
        return
    report = replay_case({**record, "model_calls": []}, tools=tools, capture=True)
    _store_inputs(record, report)


def _has_agents(record: dict[str, Any]) -> bool:
    return record["task"]["kind"] != "native" or any(_has_agents(c) for c in record["children"])


def _store_inputs(record: dict[str, Any], report: Any) -> None:
    record["model_calls"] = report.model_calls
    for child, child_report in zip(record["children"], report.children, strict=True):
        _store_inputs(child, child_report)


def export_task(
    task_id: str,
    *,
    redact: Iterable[str] = (),
    tools: ToolRegistry | None = None,
) -> dict[str, Any]:
    """The case of ``task_id`` (and its delegated children), secrets blanked. ``redact``:
    regular expressions whose matches are blanked too. ``tools``: the registry whose
    definitions the task's tools are exported with (the process's, with CHARLIE_TOOL_MODULES
    imported, by default)."""
    scrubber = Scrubber(environment_secrets(), redact)  # a bad pattern fails before any read
    if tools is None:
        import_tool_modules(settings().tool_modules)
        tools = REGISTRY
    record = _task_record(task_id, tools, 0)
    _mark_children(record)
    _capture(record, tools)
    case: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "exported_at": datetime.now(UTC).isoformat(),
        "exported_by": f"charlie {_charlie_version()}",
        **record,
    }
    scrubbed = _scrub(case, scrubber)
    scrubbed["redacted"] = {"count": scrubber.count, "patterns": len(scrubber.patterns)}
    return check_case(scrubbed, f"the export of {task_id}", replaying=False)


def _mark_children(record: dict[str, Any]) -> None:
    for child in record["children"]:
        child["model_calls"] = []
        _mark_children(child)


def _scrub(record: dict[str, Any], scrubber: Scrubber) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "task" and isinstance(value, dict):
            task = dict(scrubber.value({k: v for k, v in value.items() if k != "metadata"}))
            task["metadata"] = scrubber.metadata(value.get("metadata") or {})
            out[key] = task
        elif key == "children" and isinstance(value, list):
            out[key] = [_scrub(child, scrubber) for child in value]
        elif key in ("tools", "settings"):
            # a tool's parameter schema may name a "password": replay compares it as it is
            out[key] = scrubber.strings(value)
        else:
            out[key] = scrubber.value(value)
    return out
