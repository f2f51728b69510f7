"""The chaos round's I22 checker judges where a message entered, not which path took it in.

A message committed after a turn's results but before the model is called again is taken in at
call_model's boundary (``take_mail``) and carries the turn about to call the model; one taken
with the results carries the turn it follows. Both sit at the same boundary (I22). A message
between a turn's calls and its results is still a violation.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.backend_free

REPO = Path(__file__).resolve().parents[2]


def _chaos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("charlie_chaos", REPO / "scripts" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("charlie_chaos", module)
    spec.loader.exec_module(module)
    return module


def _item(seq: int, kind: str, turn: int, **payload: Any) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, kind=kind, turn=turn, payload=payload)


def _transcript(message_turn: int, message_at: int) -> list[SimpleNamespace]:
    items = [
        _item(1, "input", 0, role="system"),
        _item(2, "input", 0, role="user"),
        _item(3, "tool_call", 0),
        _item(4, "tool_result", 0),
        _item(5, "tool_call", 1),
        _item(6, "tool_result", 1),
        _item(7, "final", 2, content="done"),
    ]
    message = _item(0, "input", message_turn, message_id="m-1", content="hello")
    items.insert(message_at, message)
    for seq, item in enumerate(items, 1):
        item.seq = seq
    return items


def _violations(items: list[SimpleNamespace]) -> list[str]:
    chaos = _chaos()
    plan = SimpleNamespace(task_id="t")
    # sent after turn 0's results committed (seq 4 at 40 s), before turn 1's (seq 6 at 60 s)
    sent = chaos.Sent("t", "m-1", "hello", t0=45.0, t1=45.0, result="accepted")
    person = SimpleNamespace(sends=[sent], canceled=set())
    calls = [SimpleNamespace(turn=0), SimpleNamespace(turn=1)]
    when = {i.seq: 10.0 * i.seq for i in items}
    out: list[str] = chaos.check_messages(plan, person, items, calls, True, when)
    return out


@pytest.mark.parametrize("turn", [1, 2], ids=["with-the-results", "at-call-model"])
def test_a_message_after_a_turns_results_is_at_the_boundary(turn: int) -> None:
    assert _violations(_transcript(message_turn=turn, message_at=6)) == []


def test_a_message_between_a_turns_call_and_its_result_is_a_violation() -> None:
    found = _violations(_transcript(message_turn=1, message_at=5))
    assert any("not at a turn boundary" in v for v in found), found


def test_a_message_numbered_two_turns_on_is_a_violation() -> None:
    found = _violations(_transcript(message_turn=3, message_at=6))
    assert any("after 1 of turn 1's 1 results" in v for v in found), found
