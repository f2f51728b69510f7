"""Whole runs through the executor with the OpenAI-compatible HTTP client, against a real HTTP
server on 127.0.0.1 that the worker processes call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import FAKE_MODEL_KEY, Cluster
from tests.support.fake_openai import (
    FakeOpenAI,
    chat_text,
    chat_tool_calls,
    function_call_item,
    message_item,
    reasoning_item,
    response,
    usage_chat,
    usage_responses,
)

pytestmark = pytest.mark.timeout(120)


def test_chat_completions_run_two_tool_turns_then_answers(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    (workspace / "a.txt").write_text("alpha")
    model_server.enqueue(
        chat_tool_calls(
            [("c1", "read_file", '{"path": "a.txt"}'), ("c2", "list_files", "{}")],
            text="Looking first.",
            usage=usage_chat(100, 20),
        ),
        chat_tool_calls(
            [("c3", "write_file", '{"path": "b.txt", "content": "B"}')],
            usage=usage_chat(150, 30, reasoning=7),
        ),
        chat_text("Copied and done.", usage=usage_chat(200, 10)),
    )
    task_id = charlie.submit(
        "copy a to b", model="openai:fake-model", metadata={"workspace": str(workspace)}
    )
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "Copied and done."
    assert (workspace / "b.txt").read_text() == "B"
    assert info.usage == {
        "input_tokens": 450,
        "output_tokens": 60,
        "reasoning_tokens": 7,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }

    bodies = model_server.bodies
    assert len(bodies) == 3
    first, second, third = bodies
    assert first["model"] == "fake-model"
    tool_names = {t["function"]["name"] for t in first["tools"]}
    assert {"read_file", "write_file", "list_files", "run_command"} <= tool_names
    read_schema = next(t for t in first["tools"] if t["function"]["name"] == "read_file")
    assert read_schema["function"]["parameters"]["required"] == ["path"]
    # Turn 2 replays turn 1: the assistant message with both calls, then results in call order.
    tail = second["messages"][2:]
    assert tail[0]["role"] == "assistant" and tail[0]["content"] == "Looking first."
    assert [c["id"] for c in tail[0]["tool_calls"]] == ["c1", "c2"]
    assert tail[0]["tool_calls"][0]["function"]["arguments"] == '{"path": "a.txt"}'
    assert [(m["role"], m["tool_call_id"]) for m in tail[1:]] == [("tool", "c1"), ("tool", "c2")]
    assert tail[1]["content"] == "alpha"
    assert third["messages"][: len(second["messages"])] == second["messages"]
    assert third["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "c3",
        "content": json.dumps({"path": "b.txt", "bytes": 1}),
    }
    assert_every_call_has_one_result(task_id)
    # The key went over the wire and nowhere else.
    headers = {k.lower(): v for k, v in model_server.requests[0].headers.items()}
    assert headers["authorization"] == f"Bearer {FAKE_MODEL_KEY}"
    stored = json.dumps(
        [e.payload for e in charlie.transcript(task_id)] + [api.get_task(task_id).result]
    )
    assert FAKE_MODEL_KEY not in stored


def test_responses_api_passes_reasoning_back(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    (workspace / "a.txt").write_text("alpha")
    model_server.enqueue(
        response(
            [
                reasoning_item("rs_1", "I should read the file", encrypted="enc-1"),
                function_call_item("fc_1", "call_1", "read_file", '{"path": "a.txt"}'),
            ],
            usage=usage_responses(50, 5, reasoning=20),
        ),
        response([message_item("msg_1", "It says alpha.")]),
    )
    task_id = charlie.submit(
        "what does a.txt say",
        model="openai-responses:fake-reasoner",
        metadata={"workspace": str(workspace)},
    )
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "It says alpha."
    assert info.usage["reasoning_tokens"] == 20
    second = model_server.bodies[1]
    kinds = [item.get("type", item.get("role")) for item in second["input"]]
    assert kinds[-3:] == ["reasoning", "function_call", "function_call_output"]
    reasoning = second["input"][-3]
    assert reasoning["encrypted_content"] == "enc-1"
    assert second["input"][-1] == {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": "alpha",
    }
    items = charlie.transcript(task_id)
    assert [i.kind for i in items][2:] == ["reasoning", "tool_call", "tool_result", "final"]


def test_kill_after_the_response_before_the_commit_repeats_the_call_once(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    """I3: the response is committed before anything acts on it; a worker killed after the HTTP
    response but before the commit repeats the call, and the repeat is counted."""
    cluster.set_faults(
        {"tick.before_commit": {"action": "kill", "times": 1, "match": {"phase": "call_model"}}}
    )
    model_server.enqueue(chat_text("first answer, lost"), chat_text("second answer, kept"))
    task_id = charlie.submit("answer once", model="openai:fake-model")
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("tick.before_commit") == 1
    assert len(model_server.requests) == 2
    assert model_server.bodies[0] == model_server.bodies[1]  # the same call, repeated
    assert info.result["answer"] == "second answer, kept"
    assert info.model_calls == 1 and info.model_repeats == 1
    assert [i.kind for i in charlie.transcript(task_id)].count("final") == 1
