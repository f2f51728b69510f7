"""A model that plays its turns from a JSON file: for the demo, tests and chaos runs.

The file is a list of turns, or ``{"turns": [...], "ledger": "path"}``. A turn is::

    {"say": "text", "reasoning": "optional", "tool_calls": [{"id": "c1", "name": "read_file",
     "arguments": {...}}], "sleep": 0.5, "raise": "message"}

A turn without tool calls is the final answer. ``arguments`` may be a string (sent raw, to play
malformed model output); ``{task_id}`` in string arguments is replaced by the running task's id.
``sleep`` delays the answer (to stand for a slow model); ``raise`` makes the call fail, to exercise
failure handling (with ``raise_while: path``, only while that file exists: a fault that can be
fixed, for a resume). ``until: path`` holds the answer, after any ``sleep``, until that file
exists (two minutes at most): a model call that ends when a test says so. A compaction's summary
call (``request.purpose == "summary"``) is answered outside the turns with a fixed text. With a
``ledger``, every call appends one JSON line to that file, outside Charlie's tables, so repeats
after a crash can be counted. The ledger is a path relative to the script's directory and must
stay in it (no absolute path, no ``..``, no symlink out of it).

A turn may also say what the model must have been shown, so a script checks its input the way a
real model depends on it (I6, I7)::

    "expect": {"tool_results": [{"call_id": "a", "contains": "x", "outcome": "ok"}, ...],
               "contains": ["text", ...]}

``tool_results``: the results the model is shown for its previous turn (the ``tool_result``
items after the last ``tool_call`` item of the input) are exactly these calls, in this order;
``contains`` (a substring of the result's content) and ``outcome`` are optional. ``contains``:
each string occurs in the content of some input item. When the input does not match, the call
raises :class:`ModelError` saying what was expected and what was shown, and the run fails with
that message; nothing of the turn is played.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from charlie.domain import Item, ItemKind, NewItem
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
        ledger = ledger_path(path, doc["ledger"]) if doc.get("ledger") else None
        doc = doc.get("turns")
    if not isinstance(doc, list) or not doc:
        raise ScriptError(
            f"scripted model file {path}: expected a non-empty list of turns "
            '(or {"turns": [...]}), got ' + type(doc).__name__
        )
    # Turns count from 0, as the run's record, `charlie show`, the console and `fork --turn`.
    for number, turn in enumerate(doc):
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
        problem = _expect_problem(turn.get("expect"))
        if problem:
            raise ScriptError(f"scripted model file {path}: turn {number}: {problem}")
    return doc, ledger


def ledger_path(script: Path, ledger: Any) -> Path:
    """Where a script's ledger is: a relative path that stays in the script's directory, by
    its real path (no ``..``, no symlink out of it). A script names a file it appends to, so
    it may name none outside its own directory."""
    where = f"scripted model file {script}: ledger {ledger!r}"
    if not isinstance(ledger, str):
        raise ScriptError(f"{where} must be a path (a string)")
    relative = Path(ledger)
    if relative.is_absolute():
        raise ScriptError(
            f"{where} is absolute; a ledger is a path relative to the script's directory "
            "and stays in it"
        )
    if ".." in relative.parts:
        raise ScriptError(f"{where} has a '..'; a ledger stays in the script's directory")
    home = script.parent.resolve()
    resolved = (home / relative).resolve()
    if resolved == home or home not in resolved.parents:
        raise ScriptError(
            f"{where} resolves to {resolved}, outside the script's directory {home} "
            "(a symlink?); a ledger stays in the script's directory"
        )
    return resolved


def _append_ledger(script: Path, ledger: Path, line: str) -> None:
    """Append one line to the ledger, checked again as it is opened: a symlink put in its
    place since the script was loaded is not followed (O_NOFOLLOW), nor a directory above it
    swapped for one (its real path must still be the one checked at load)."""
    if ledger.parent.resolve() != ledger.parent:
        raise ModelError(
            f"scripted model {script}: ledger {ledger} is no longer in the script's directory"
        )
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "a") as out:
        out.write(line)


def _expect_problem(expect: Any) -> str | None:
    """What is wrong with a turn's ``expect``, if anything."""
    if expect is None:
        return None
    if not isinstance(expect, dict):
        return '"expect" must be an object'
    unknown = set(expect) - {"tool_results", "contains"}
    if unknown:
        return f'"expect" has unknown keys {sorted(unknown)} (known: tool_results, contains)'
    results = expect.get("tool_results", [])
    if not isinstance(results, list) or any(
        not isinstance(r, dict)
        or not isinstance(r.get("call_id"), str)
        or set(r) - {"call_id", "contains", "outcome"}
        for r in results
    ):
        return (
            '"expect.tool_results" must be a list of objects with a "call_id" and optional '
            '"contains" and "outcome"'
        )
    contains = expect.get("contains", [])
    if not isinstance(contains, list) or any(not isinstance(c, str) for c in contains):
        return '"expect.contains" must be a list of strings'
    return None


def _shown_results(items: list[Item]) -> list[Item]:
    """The tool results the model is shown for its previous turn: the ``tool_result`` items
    after the input's last ``tool_call`` item (none on a first turn)."""
    last_call = max((n for n, i in enumerate(items) if i.kind is ItemKind.TOOL_CALL), default=None)
    if last_call is None:
        return []
    return [i for i in items[last_call + 1 :] if i.kind is ItemKind.TOOL_RESULT]


def _describe_expected(wanted: dict[str, Any]) -> str:
    text = str(wanted["call_id"])
    if "outcome" in wanted:
        text += f" {wanted['outcome']}"
    if "contains" in wanted:
        text += f" containing {wanted['contains']!r}"
    return text


def _describe_shown(item: Item, limit: int = 120) -> str:
    content = str(item.payload.get("content", ""))
    if len(content) > limit:
        content = content[:limit] + "..."
    return f"{item.call_id} {item.payload.get('outcome')} {content!r}"


def check_expectation(expect: dict[str, Any], items: list[Item]) -> str | None:
    """None if the model input ``items`` meets ``expect``, else what was expected vs shown."""
    problems = []
    if "tool_results" in expect:
        wanted = expect["tool_results"]
        shown = _shown_results(items)
        matches = len(wanted) == len(shown) and all(
            w["call_id"] == s.call_id
            and ("outcome" not in w or w["outcome"] == s.payload.get("outcome"))
            and ("contains" not in w or str(w["contains"]) in str(s.payload.get("content", "")))
            for w, s in zip(wanted, shown, strict=False)
        )
        if not matches:
            problems.append(
                "expected the previous turn's tool results, in this order, to be ["
                + "; ".join(_describe_expected(w) for w in wanted)
                + "] but the model was shown ["
                + "; ".join(_describe_shown(s) for s in shown)
                + "]"
            )
    contents = [str(i.payload.get("content", "")) for i in items]
    missing = [c for c in expect.get("contains", []) if not any(c in text for text in contents)]
    if missing:
        problems.append(
            f"expected the input to contain {missing!r} but no input item's content does "
            f"({len(items)} items shown)"
        )
    return "; ".join(problems) or None


def _substitute(value: Any, task_id: str) -> Any:
    if isinstance(value, str):
        return value.replace("{task_id}", task_id)
    if isinstance(value, list):
        return [_substitute(v, task_id) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, task_id) for k, v in value.items()}
    return value


#: the longest a turn's ``until`` holds its answer (seconds)
UNTIL_LIMIT = 120.0


def _wait_for_file(path: Path, limit: float) -> None:
    end = time.monotonic() + limit
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


class ScriptedModel:
    def __init__(self, spec: str, path: Path) -> None:
        self.spec = spec
        self.path = path
        self.turns, self.ledger = load_script(path)

    def complete(self, request: ModelRequest) -> ModelResponse:
        if request.purpose == "summary":
            return _summary(request)
        if self.ledger is not None:
            _append_ledger(
                self.path,
                self.ledger,
                json.dumps(
                    {
                        "task_id": request.task_id,
                        "turn": request.turn,
                        "pid": os.getpid(),
                        "input_chars": _input_chars(request.items),
                    }
                )
                + "\n",
            )
        if request.turn >= len(self.turns):
            raise ModelError(
                f"scripted model {self.path} has {len(self.turns)} turns; "
                f"turn {request.turn} (counting from 0) was asked for"
            )
        turn = self.turns[request.turn]
        if turn.get("expect") is not None:
            problem = check_expectation(_substitute(turn["expect"], request.task_id), request.items)
            if problem:
                raise ModelError(
                    f"scripted model {self.path}: turn {request.turn} input mismatch: {problem}",
                    evidence={"expect": turn["expect"]},
                )
        if turn.get("sleep"):
            time.sleep(float(turn["sleep"]))
        if turn.get("until"):
            _wait_for_file(Path(str(turn["until"])), UNTIL_LIMIT)
        if turn.get("raise") and (
            not turn.get("raise_while") or Path(str(turn["raise_while"])).exists()
        ):
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
        _stream(request, output)
        return ModelResponse(output=output, usage=Usage(output_tokens=len(text) // 4))


def _input_chars(items: list[Item]) -> int:
    """The characters of content the model was sent (a ledger's measure of its input)."""
    return sum(
        len(str(i.payload.get("content") or "")) + len(str(i.payload.get("raw_arguments") or ""))
        for i in items
    )


def _summary(request: ModelRequest) -> ModelResponse:
    """A compaction's summary call, outside the script's turns (its turn is being played): a
    fixed text naming how much it was given, so the same input gets the same summary."""
    given = sum(len(str(i.payload.get("content", ""))) for i in request.items)
    text = f"(scripted summary of {given} characters of the record before turn {request.turn})"
    return ModelResponse(
        output=[NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text})],
        usage=Usage(output_tokens=len(text) // 4),
    )


def _stream(request: ModelRequest, output: list[NewItem]) -> None:
    """What a streaming client would send while writing this turn, in one piece each (so
    watchers and the benchmark see a scripted run stream too; never the answer, I28)."""
    deltas = request.deltas
    for item in output:
        if item.kind is ItemKind.REASONING:
            deltas.reasoning(str(item.payload.get("summary") or ""))
        elif item.kind is ItemKind.MESSAGE:
            deltas.text(str(item.payload.get("content") or ""))
        elif item.kind is ItemKind.TOOL_CALL:
            raw = str(item.payload.get("raw_arguments", ""))
            deltas.tool_call(item.call_id or "", str(item.payload.get("name")), raw)
