"""The scripted model checks what it was shown (its ``expect``), so scripted runs test a turn's
input as the HTTP model tests do: the previous turn's results, in call order (I6, I7, I8)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import api
from charlie.domain import Item, ItemKind, TaskStatus
from charlie.models.scripted import ScriptError, check_expectation, load_script
from tests.conftest import model_calls
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import Cluster

pytestmark = pytest.mark.timeout(120)

Script = Callable[[list[dict[str, Any]]], tuple[str, Path]]


def _three_calls_out_of_finish_order() -> list[dict[str, Any]]:
    """Three reads that finish in the reverse of the order the model made them."""
    return [
        {"id": "slow", "name": "sleep_then", "arguments": {"seconds": 1.5, "value": "A-slow"}},
        {"id": "mid", "name": "sleep_then", "arguments": {"seconds": 0.7, "value": "B-mid"}},
        {"id": "fast", "name": "sleep_then", "arguments": {"seconds": 0.0, "value": "C-fast"}},
    ]


def test_next_turn_is_shown_the_previous_results_in_call_order(
    cluster: Cluster, script: Script
) -> None:
    """I6, I7: the model input of turn 2 holds turn 1's tool results in the order the model
    made the calls, not the order they finished; turn 3 is shown turn 2's one result (and the
    prompt is still there, I6: the context plus the transcript)."""
    model, ledger = script(
        [
            {"tool_calls": _three_calls_out_of_finish_order()},
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "slow", "contains": "A-slow", "outcome": "ok"},
                        {"call_id": "mid", "contains": "B-mid", "outcome": "ok"},
                        {"call_id": "fast", "contains": "C-fast", "outcome": "ok"},
                    ],
                    "contains": ["check my input"],
                },
                "tool_calls": [{"id": "e", "name": "boom", "arguments": {"message": "kaput"}}],
            },
            {
                "expect": {
                    "tool_results": [{"call_id": "e", "outcome": "error", "contains": "kaput"}],
                    "contains": ["check my input", "A-slow"],
                },
                "say": "all seen",
            },
        ]
    )
    task_id = charlie.submit("check my input", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "all seen"
    assert [c["turn"] for c in model_calls(ledger)] == [0, 1, 2]
    records = {c.call_id: c for c in api.calls(task_id) if c.turn == 0}
    # The finishing order really differed from the call order the model was shown.
    fast, slow = records["fast"].finish_order, records["slow"].finish_order
    assert fast is not None and slow is not None and fast < slow
    assert_every_call_has_one_result(task_id)


def test_an_input_mismatch_fails_the_run_saying_what_was_expected(
    cluster: Cluster, script: Script
) -> None:
    """A turn whose input does not match its ``expect`` fails the run (I17) with a message that
    says what was expected and what was shown; the model's turn is not played."""
    model, ledger = script(
        [
            {"tool_calls": _three_calls_out_of_finish_order()},
            {
                "expect": {
                    "tool_results": [
                        {"call_id": "fast"},
                        {"call_id": "mid"},
                        {"call_id": "slow"},
                    ]
                },
                "say": "must not be the answer",
            },
        ]
    )
    task_id = charlie.submit("finish order is not call order", model=model)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert info.error["phase"] == "call_model"
    assert info.error["type"] == "ModelError"
    message = info.error["message"]
    # turns count from 0 everywhere (the record, show, the console, fork --turn): the second
    # model call is turn 1
    assert "turn 1 input mismatch" in message
    assert "[fast; mid; slow]" in message  # what was expected
    assert "slow ok 'A-slow'; mid ok 'B-mid'; fast ok 'C-fast'" in message  # what was shown
    assert len(model_calls(ledger)) == 2  # a ModelError is not retried
    assert not any(i.kind == "final" for i in charlie.transcript(task_id))


def _item(seq: int, kind: ItemKind, call_id: str | None = None, **payload: object) -> Item:
    return Item(seq=seq, turn=0, kind=kind, call_id=call_id, payload=dict(payload))


def test_check_expectation_looks_only_at_the_latest_results() -> None:
    """Results of earlier turns are not the previous turn's results; a first turn has none."""
    items = [
        _item(0, ItemKind.INPUT, role="user", content="hi"),
        _item(1, ItemKind.TOOL_CALL, "a", name="x"),
        _item(2, ItemKind.TOOL_RESULT, "a", outcome="ok", content="old"),
        _item(3, ItemKind.TOOL_CALL, "b", name="x"),
        _item(4, ItemKind.TOOL_RESULT, "b", outcome="ok", content="new"),
    ]
    assert check_expectation({"tool_results": [{"call_id": "b", "contains": "new"}]}, items) is None
    problem = check_expectation({"tool_results": [{"call_id": "a"}]}, items)
    assert problem is not None and "[a]" in problem and "b ok 'new'" in problem
    assert check_expectation({"tool_results": []}, items[:1]) is None
    assert check_expectation({"contains": ["hi", "old"]}, items) is None
    missing = check_expectation({"contains": ["nowhere"]}, items)
    assert missing is not None and "'nowhere'" in missing


@pytest.mark.parametrize(
    "expect",
    [
        "not an object",
        {"tool_result": []},
        {"tool_results": [{"contains": "x"}]},
        {"tool_results": [{"call_id": "a", "extra": 1}]},
        {"contains": "not a list"},
    ],
)
def test_a_malformed_expect_is_refused_when_the_script_loads(
    tmp_path: Path, expect: object
) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"say": "x", "expect": expect}]))
    with pytest.raises(ScriptError, match="turn 0"):
        load_script(path)
