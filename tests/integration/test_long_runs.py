"""Long runs through real workers against a real HTTP model server that refuses any input over
its context window, as providers do (I29): the model input stays under the window, by eliding
older results and summarising older turns, and the durable record keeps every result whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import charlie
from charlie.console.rows import transcript_rows as console_rows
from charlie.domain import TaskStatus
from charlie.views import transcript_rows
from tests.integration.test_loop import assert_every_call_has_one_result
from tests.support import fake_anthropic as anthropic
from tests.support.cluster import FAKE_WINDOW_TOKENS, Cluster
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.fake_openai import FakeOpenAI, Reply, chat_text, chat_tool_calls, error

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
    # ...and so does the console, the summary's text beside it
    rows = console_rows(charlie.transcript(task_id), charlie.calls(task_id))
    marked = [r for r in rows if r.kind == "compaction"]
    assert len(marked) == len(compactions)
    assert marked[0].who.startswith(f"compaction of items {first}-{last}")
    assert marked[0].text == compactions[0].payload["content"]


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
    # A fork keeps what the run learned (the window the refusal showed): its first input, from
    # a turn whose history alone is over the window, is not refused again.
    items = charlie.transcript(task_id)
    turn = next(i.turn for i in items if i.kind == "compaction") - 1
    history = sum(len(json.dumps(i.payload)) for i in items if i.turn <= turn)
    assert history // 4 > FAKE_WINDOW_TOKENS
    refused = len(model_server.refused)
    model_server.enqueue(chat_text("the fork's answer"))
    fork_id = charlie.fork(task_id, turn=turn)
    forked = charlie.wait(fork_id, timeout=60)
    assert forked.status is TaskStatus.SUCCEEDED, forked.error
    assert len(model_server.refused) == refused


def test_a_worker_killed_during_a_summary_repeats_only_that_call(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    """SIGKILL after the summary came back, before it was recorded: the next worker makes the
    summary call again (the only work repeated, I3), and the record holds one summary of the
    range (I29)."""
    cluster.set_faults({"call_model.summarised": {"action": "kill", "times": 1}})
    model_server.window = FAKE_WINDOW_TOKENS
    script_long_run(model_server, workspace)
    task_id = submit_long_run("openai:fake-windowed", workspace)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert cluster.fault_count("call_model.summarised") == 1
    compactions = [i for i in charlie.transcript(task_id) if i.kind == "compaction"]
    covered = [tuple(c.payload["covers"]) for c in compactions]
    assert covered and len(set(covered)) == len(covered)
    # the killed summary call was made twice, with the same input; nothing else repeated
    assert len(model_server.summaries) == len(compactions) + 1
    assert model_server.summaries[0].body == model_server.summaries[1].body
    assert info.model_repeats == 1
    assert model_server.refused == []
    assert_record_whole(task_id)


def test_resume_and_fork_after_a_compaction(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    """A run that failed after compacting resumes with the same model input (a pure function
    of the durable transcript, I29); a fork from after the compaction starts from its summary
    and runs no tool call again (I26)."""
    model_server.window = FAKE_WINDOW_TOKENS
    replies = script_long_run(model_server, workspace)
    model_server.reset()
    model_server.window = FAKE_WINDOW_TOKENS
    model_server.enqueue(*replies[:-1], error(400, "fake: refused once", code="invalid_request"))
    task_id = submit_long_run("openai:fake-windowed", workspace)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.FAILED, info
    assert any(i.kind == "compaction" for i in charlie.transcript(task_id))
    failed_input = model_server.requests[-1].body

    model_server.enqueue(chat_text("resumed and done"))
    charlie.resume(task_id)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert model_server.requests[-1].body == failed_input  # the same input, again
    assert_record_whole(task_id)

    last_turn = charlie.transcript(task_id)[-1].turn
    model_server.enqueue(chat_text("the fork's answer"))
    fork_id = charlie.fork(task_id, turn=last_turn, message="and one line more")
    forked = charlie.wait(fork_id, timeout=60)
    assert forked.status is TaskStatus.SUCCEEDED, forked.error
    assert forked.result["answer"] == "the fork's answer"
    sent = model_server.bodies[-1]["messages"]
    assert sent[1]["content"] == "read every page, one at a time"
    assert "Summary of the earlier work" in sent[2]["content"]
    assert sent[-1]["content"] == "and one line more"
    assert model_server.refused == []
    assert charlie.calls(fork_id) == []  # no tool call ran again (I26)


def test_a_window_too_small_for_the_prompt_fails_the_task_at_once(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    task_id = charlie.submit("x " * 12_000, model="openai:fake-windowed", tools=["read_file"])
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.FAILED
    assert "CHARLIE_MODEL_FAKE_WINDOWED_CONTEXT_TOKENS" in str(info.error)
    assert model_server.requests == []  # nothing was sent


@pytest.mark.parametrize("model", ["claude-fake-windowed", "claude-fake"])
def test_forty_turns_on_anthropic_stay_under_its_window(
    cluster: Cluster, anthropic_server: FakeAnthropic, workspace: Path, model: str
) -> None:
    """Anthropic's Messages API: with the window configured nothing is refused; without it,
    its 400 "prompt is too long" is enough."""
    anthropic_server.window = FAKE_WINDOW_TOKENS
    for n in range(TURNS):
        (workspace / f"p{n:03d}.txt").write_text(page(n))
        args = {"path": f"p{n:03d}.txt"}
        anthropic_server.enqueue(
            anthropic.message(anthropic.tool_use(f"t{n:03d}", "read_file", args))
        )
    anthropic_server.enqueue(anthropic.message(anthropic.text("read them all")))
    task_id = submit_long_run(f"anthropic:{model}", workspace)
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert info.result["answer"] == "read them all"
    refused = len(anthropic_server.refused)
    assert refused == 0 if model == "claude-fake-windowed" else 1 <= refused <= 3
    assert len(anthropic_server.summaries) >= 1
    assert_record_whole(task_id)


def test_a_message_sent_during_a_summary_enters_once_at_a_boundary(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    """I22 across a compaction: a message committed while the summary call runs enters the
    transcript once, after the compaction and before the next model call, and that call
    shows it."""
    model_server.window = FAKE_WINDOW_TOKENS
    model_server.summary_delay = 1.5
    script_long_run(model_server, workspace)
    task_id = submit_long_run("openai:fake-windowed", workspace)
    assert model_server.summary_started.wait(120)
    charlie.send(task_id, "a note sent during the summary", message_id="m-during")
    info = charlie.wait(task_id, timeout=200)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    items = charlie.transcript(task_id)
    notes = [i for i in items if i.payload.get("content") == "a note sent during the summary"]
    assert len(notes) == 1
    first_compaction = next(i for i in items if i.kind == "compaction")
    assert notes[0].seq > first_compaction.seq
    # it came at a boundary: no tool_call of its turn is without its result before it (I8)
    before = items[: notes[0].seq]
    calls = {i.call_id for i in before if i.kind == "tool_call"}
    assert calls == {i.call_id for i in before if i.kind == "tool_result"}
    shown = [
        body for body in model_server.bodies if "a note sent during the summary" in json.dumps(body)
    ]
    assert shown and model_server.refused == []
    assert_record_whole(task_id)
