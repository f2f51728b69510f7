"""Long runs through real workers against a real HTTP model server that refuses any input over
its context window, as providers do (I29): the model input stays under the window, by eliding
older results and summarising older turns, and the durable record keeps every result whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.views import transcript_rows
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support.cluster import FAKE_WINDOW_TOKENS, Cluster
from tests.support.fake_openai import FakeOpenAI, Reply, chat_text, chat_tool_calls

pytestmark = pytest.mark.timeout(240)

TURNS = 40
RESULT_BYTES = 4096


def page(n: int) -> str:
    """A 4 KiB text file, different for each turn (so a result is recognisable in an input)."""
    line = f"page {n:03d}: the quick brown fox jumps over the lazy dog "
    text = (line * (RESULT_BYTES // len(line) + 1))[: RESULT_BYTES - 1] + "\n"
    assert len(text) == RESULT_BYTES
    return text


def script_long_run(server: FakeOpenAI, workspace: Path, turns: int = TURNS) -> list[Reply]:
    replies = []
    for n in range(turns):
        (workspace / f"p{n:03d}.txt").write_text(page(n))
        replies.append(
            chat_tool_calls([(f"c{n:03d}", "read_file", json.dumps({"path": f"p{n:03d}.txt"}))])
        )
    replies.append(chat_text("read them all"))
    server.enqueue(*replies)
    return replies


def submit_long_run(model: str, workspace: Path) -> str:
    return charlie.submit(
        "read every page, one at a time",
        model=model,
        tools=["read_file", "recall"],
        metadata={"workspace": str(workspace)},
    )


def assert_record_whole(task_id: str, turns: int = TURNS) -> None:
    """The record never shrinks: every result as the tool returned it, in one chronology."""
    items = charlie.transcript(task_id)
    assert [i.seq for i in items] == list(range(len(items)))  # I6
    results = [i for i in items if i.kind == "tool_result"]
    assert [r.payload["content"] for r in results] == [page(n) for n in range(turns)]
    assert_every_call_has_one_result(task_id)


def counted(body: bytes) -> int:
    return len(body) // 4


def test_forty_turns_stay_under_the_configured_window(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    model_server.window = FAKE_WINDOW_TOKENS
    script_long_run(model_server, workspace)
    task_id = submit_long_run("openai:fake-windowed", workspace)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "read them all"
    # No request was refused: every input, the summary calls' too, fit the window.
    assert model_server.refused == []
    assert max(counted(r.raw) for r in model_server.requests) <= FAKE_WINDOW_TOKENS
    # 160 KiB of results went through a 20 KB window: older ones elided, older turns summarised.
    assert len(model_server.summaries) >= 1
    last = model_server.bodies[-1]["messages"]
    assert last[0]["role"] == "system"
    assert last[1] == {"role": "user", "content": "read every page, one at a time"}
    assert any("recall" in str(m.get("content")) for m in last)  # an elided result's stub
    assert_record_whole(task_id)
    compactions = [i for i in charlie.transcript(task_id) if i.kind == "compaction"]
    assert len(compactions) == len(model_server.summaries)
    covered = [tuple(c.payload["covers"]) for c in compactions]
    assert len(set(covered)) == len(covered)  # one range has at most one summary
    for c in compactions:
        assert c.payload["tokens_after"] < c.payload["tokens_before"]
        assert c.payload["model"] == "openai:fake-windowed"
    # charlie show marks each compaction: what it covers, tokens before and after
    shown = [line for _, line in transcript_rows(task_id) if "compaction of items" in line]
    first, last = compactions[0].payload["covers"]
    assert len(shown) == len(compactions) and f"compaction of items {first}-{last}" in shown[0]


def test_forty_turns_fit_a_window_learned_from_the_refusal(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    """No window configured: the provider's 400 context_length_exceeded is enough."""
    model_server.window = FAKE_WINDOW_TOKENS
    script_long_run(model_server, workspace)
    task_id = submit_long_run("openai:fake-model", workspace)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "read them all"
    assert 1 <= len(model_server.refused) <= 3
    assert len(model_server.summaries) >= 1
    assert_record_whole(task_id)
