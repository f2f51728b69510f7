"""A model that plays its turns from a JSON file: for the demo, tests and chaos runs.

The file is a list of turns, or ``{"turns": [...], "ledger": "path"}``. A turn is::

    {"say": "text", "reasoning": "optional", "tool_calls": [{"id": "c1", "name": "read_file",
     "arguments": {...}}], "sleep": 0.5, "raise": "message"}

A turn without tool calls is the final answer. ``arguments`` may be a string (sent raw, to play
malformed model output); ``{task_id}`` in string arguments is replaced by the running task's id.
``sleep`` delays the answer (to stand for a slow model); ``raise`` makes the call fail, to exercise
failure handling. With a ``ledger``, every call appends one JSON line to that file, outside
Charlie's tables, so repeats after a crash can be counted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from charlie.domain import ItemKind, NewItem
from charlie.models.base import (
    ModelError,
    ModelRequest,
    ModelResponse,
    Usage,
    tool_call_item,
)


class ScriptError(ValueError):
    """The script file cannot be used; raised at submit, before anything is written."""


def load_script(path: Path) -> tuple[list[dict[str, Any]], Path | None]:
    try:
        raw = path.read_text()
    except OSError as exc:
        raise ScriptError(f"scripted model file {path}: cannot read it ({exc.strerror})") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ScriptError(f"scripted model file {path} is not valid JSON: {exc}") from exc
    ledger = None
    if isinstance(doc, dict):
        ledger = Path(doc["ledger"]) if doc.get("ledger") else None
        doc = doc.get("turns")
    if not isinstance(doc, list) or not doc:
        raise ScriptError(
            f"scripted model file {path}: expected a non-empty list of turns "
            '(or {"turns": [...]}), got ' + type(doc).__name__
        )
    for number, turn in enumerate(doc, 1):
        if not isinstance(turn, dict):
            raise ScriptError(f"scripted model file {path}: turn {number} is not an object")
        calls = turn.get("tool_calls", [])
        if not isinstance(calls, list) or any(
            not isinstance(c, dict) or "name" not in c for c in calls
        ):
            raise ScriptError(
                f"scripted model file {path}: turn {number}: tool_calls must be a list of "
                'objects with a "name"'
            )
    return doc, ledger


def _substitute(value: Any, task_id: str) -> Any:
    if isinstance(value, str):
        return value.replace("{task_id}", task_id)
    if isinstance(value, list):
        return [_substitute(v, task_id) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, task_id) for k, v in value.items()}
    return value


class ScriptedModel:
    def __init__(self, spec: str, path: Path) -> None:
        self.spec = spec
        self.path = path
        self.turns, self.ledger = load_script(path)

    def complete(self, request: ModelRequest) -> ModelResponse:
        if self.ledger is not None:
            with open(self.ledger, "a") as ledger:
                ledger.write(
                    json.dumps(
                        {"task_id": request.task_id, "turn": request.turn, "pid": os.getpid()}
                    )
                    + "\n"
                )
        if request.turn >= len(self.turns):
            raise ModelError(
                f"scripted model {self.path} has {len(self.turns)} turns; "
                f"turn {request.turn + 1} was asked for"
            )
        turn = self.turns[request.turn]
        if turn.get("sleep"):
            time.sleep(float(turn["sleep"]))
        if turn.get("raise"):
            raise RuntimeError(str(turn["raise"]))
        output: list[NewItem] = []
        if turn.get("reasoning"):
            output.append(NewItem(ItemKind.REASONING, {"summary": turn["reasoning"], "raw": None}))
        if turn.get("say") is not None:
            output.append(NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": turn["say"]}))
        for number, call in enumerate(turn.get("tool_calls", [])):
            call_id = str(call.get("id") or f"t{request.turn}c{number}")
            args = _substitute(call.get("arguments", {}), request.task_id)
            output.append(tool_call_item(call_id, str(call["name"]), args))
        text = json.dumps([i.payload for i in output])
        return ModelResponse(output=output, usage=Usage(output_tokens=len(text) // 4))
