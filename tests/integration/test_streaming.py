"""Streaming for people watching, through real workers and a real HTTP model on 127.0.0.1
(I28: a stream is never the answer; I16: the answer is written once; I3: a worker killed
mid-stream repeats only the model call). The fake server holds a stream open until the test
has seen its first deltas, so "while the call is still open" needs no clock."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import ItemKind, TaskStatus
from charlie.streams.base import StreamEvent
from tests.conftest import wait_for
from tests.support.cluster import REPO, Cluster
from tests.support.fake_openai import (
    FakeOpenAI,
    Reply,
    chat_stream,
    chat_text,
    function_call_item,
    message_item,
    responses_stream,
)

pytestmark = pytest.mark.timeout(180)

ANSWER = "It says alpha, and that is the whole answer."


def follow(task_id: str, until: Callable[[list[StreamEvent]], bool], release: Reply) -> list[Any]:
    """Read charlie.events until ``until`` holds (then let the held stream go on), to the end."""
    seen: list[StreamEvent] = []
    try:
        for event in charlie.events(task_id, timeout=150):
            seen.append(event)
            if not release.release.is_set() and until(seen):
                release.release.set()
    finally:
        release.release.set()
    return seen


def texts(events: list[StreamEvent], call: str, kind: str = "text") -> str:
    return "".join(e.data["text"] for e in events if e.type == kind and e.data["call"] == call)


def calls_started(events: list[StreamEvent]) -> list[str]:
    return [e.data["call"] for e in events if e.type == "model_start"]


def tool_turn(spec: str) -> Reply:
    """A first turn that writes a little text and one tool call, held in the middle of the
    call's arguments until the test lets it go."""
    if spec.startswith("openai:"):
        # frames: role, 3 text pieces, the call's opening, then its argument pieces
        return chat_stream("Let me look.", [("c1", "read_file", '{"path": "a.txt"}')], hold_at=7)
    output = [
        message_item("m1", "Let me look."),
        function_call_item("fc1", "c1", "read_file", '{"path": "a.txt"}'),
    ]
    # frames: created, added, 3 text deltas, done, added, then the argument deltas
    return responses_stream(output, hold_at=9)


def answer_turn(spec: str) -> Reply:
    if spec.startswith("openai:"):
        return chat_stream(ANSWER)
    return responses_stream([message_item("m2", ANSWER)])


@pytest.mark.parametrize("spec", ["openai:fake-streamer", "openai-responses:fake-streamer"])
def test_text_and_tool_arguments_stream_while_the_call_is_open_and_a_late_reader_gets_it_all(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path, spec: str
) -> None:
    (workspace / "a.txt").write_text("alpha")
    first = tool_turn(spec)
    model_server.enqueue(first, answer_turn(spec))
    task_id = charlie.submit("read a.txt", model=spec, metadata={"workspace": str(workspace)})

    def open_call_streamed(seen: list[StreamEvent]) -> bool:
        # the text and part of the arguments arrived, and the call is still held open
        return any(e.type == "tool_args" for e in seen) and not first.release.is_set()

    live = follow(task_id, open_call_streamed, first)
    assert first.reached.is_set()
    kinds = [e.type for e in live]
    # what the watcher saw before the held stream went on: text and arguments of an open call
    before_end = kinds[: kinds.index("model_end")]
    assert "text" in before_end and "tool_args" in before_end
    one, two = calls_started(live)
    assert texts(live, one) == "Let me look."
    assert "".join(e.data["text"] for e in live if e.type == "tool_args") == '{"path": "a.txt"}'
    assert texts(live, two) == ANSWER
    ends = [(e.data["call"], e.data["status"]) for e in live if e.type == "model_end"]
    assert ends == [(one, "completed"), (two, "completed")]
    # tool calls as they are made and settle, after the commits that record them
    assert [e.data["name"] for e in live if e.type == "tool_call"] == ["read_file"]
    assert any(e.type == "tool_settled" and e.data["outcome"] == "ok" for e in live)
    assert kinds[-1] == "end" and live[-1].data["status"] == "succeeded"
    assert kinds.index("tool_call") > kinds.index("model_end")

    info = charlie.get_task(task_id)
    assert info.status is TaskStatus.SUCCEEDED and info.result["answer"] == ANSWER
    assert [b.get("stream") for b in model_server.bodies] == [True, True]

    # a late reader gets everything from offset 0...
    late = list(charlie.events(task_id))
    assert [(e.offset, e.data) for e in late[:-1]] == [(e.offset, e.data) for e in live[:-1]]
    assert late[-1].type == "end"
    # ...and one resuming from an offset gets only what followed it
    middle = len(live) // 2
    rest = list(charlie.events(task_id, after=live[middle].offset))
    assert [e.data for e in rest[:-1]] == [e.data for e in live[middle + 1 : -1]]
    # not following: what is there now, then stop
    assert [e.offset for e in charlie.events(task_id, follow=False)] == [e.offset for e in late]


def test_charlie_watch_prints_the_text_while_the_call_is_open_and_exits_as_wait_does(
    cluster: Cluster, model_server: FakeOpenAI, workspace: Path
) -> None:
    spec = "openai:fake-watched"
    shown = "Hello \x1b[2Jwatcher, here is the answer."
    held = chat_stream(shown, hold_at=5, hold_seconds=90)
    model_server.enqueue(held)
    task_id = charlie.submit("say hello", model=spec)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "charlie", "watch", task_id],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out = bytearray()

    def read() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(4096):
            out.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # "Hello \x1b[2Jw" is the first three pieces of four characters: shown while held
        while b"Hello \\x1b[2Jw" not in out:
            assert proc.poll() is None, out.decode()
            assert time.monotonic() < deadline, out.decode()
            time.sleep(0.05)
        assert not held.release.is_set()
        held.release.set()
        assert proc.wait(timeout=120) == 0, out.decode()
    finally:
        held.release.set()
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    text = out.decode()
    assert "\x1b" not in text  # the model's escape is shown, never obeyed
    assert "Hello \\x1b[2Jwatcher, here is the answer." in text
    assert "succeeded:" in text


def test_a_worker_killed_mid_stream_leaves_an_abandoned_stream_and_one_whole_answer(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    spec = "openai:fake-killed"
    partial = "This first attempt dies with its worker"
    cut_short = chat_stream(partial, hold_at=4, hold_seconds=60)
    model_server.enqueue(cut_short, chat_stream(ANSWER))
    task_id = charlie.submit("answer once", model=spec)
    seen: list[StreamEvent] = []
    killed = False
    try:
        for event in charlie.events(task_id, timeout=150):
            seen.append(event)
            if not killed and event.type == "text":
                with cluster._lock:  # SIGKILL every worker mid-stream; the supervisor restarts
                    for proc in cluster.alive_workers():
                        cluster.kill(proc)
                killed = True
    finally:
        cut_short.release.set()
    assert killed
    first, second = calls_started(seen)
    kinds = [(e.type, e.data.get("call"), e.data.get("status")) for e in seen]
    abandoned = kinds.index(("model_end", first, "abandoned"))
    assert abandoned < kinds.index(("model_start", second, None))
    # what the killed attempt had streamed: a part, shown and marked abandoned, never the answer
    assert texts(seen, first) and partial.startswith(texts(seen, first))
    assert texts(seen, second) == ANSWER
    assert ("model_end", second, "completed") in kinds
    assert ("model_end", first, "completed") not in kinds
    assert seen[-1].type == "end" and seen[-1].data["status"] == "succeeded"
    # I16: one whole answer, written once; I3: only the model call was repeated
    info = charlie.get_task(task_id)
    assert info.result["answer"] == ANSWER
    finals = [e for e in charlie.transcript(task_id) if e.kind == ItemKind.FINAL.value]
    assert [f.payload["content"] for f in finals] == [ANSWER]
    assert len(model_server.requests) == 2


def test_streaming_off_sends_nothing_and_asks_for_no_stream(
    cluster: Cluster, model_server: FakeOpenAI
) -> None:
    with cluster.configured(CHARLIE_STREAMING="0"):
        model_server.enqueue(chat_text("quietly done"))
        task_id = charlie.submit("quiet", model="openai:fake-quiet")
        info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    assert "stream" not in model_server.bodies[0]
    # the workers wrote no event: a reader gets only the end, from the record
    assert [e.type for e in charlie.events(task_id)] == ["end"]


def test_a_wait_for_a_person_and_its_approval_stream_after_their_commits(
    cluster: Cluster, script: Any
) -> None:
    """Tool, wait and end events come from the commits that record them (I28), with a scripted
    model (which streams its turn in one piece per item)."""
    model, _ = script(
        [
            {
                "say": "Writing it.",
                "tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "s1"}}],
            },
            {"say": "Written.", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("write once approved", model=model, approve=["ledger_write"])
    seen: list[StreamEvent] = []
    approved = False
    for event in charlie.events(task_id, timeout=150):
        seen.append(event)
        if event.type == "waiting" and not approved:
            # the wait was committed before it was streamed: the task says so already
            assert charlie.get_task(task_id).waiting_for
            charlie.approve(task_id, "w")
            approved = True
    kinds = [e.type for e in seen]
    (waiting,) = [e for e in seen if e.type == "waiting"]
    assert waiting.data["calls"] == [
        {"call_id": "w", "name": "ledger_write", "hold": "approval", "question": None}
    ]
    assert kinds.index("tool_call") < kinds.index("waiting") < kinds.index("verdict")
    (verdict,) = [e.data for e in seen if e.type == "verdict"]
    assert (verdict["call_id"], verdict["action"]) == ("w", "approve")
    assert [e.data["outcome"] for e in seen if e.type == "tool_settled"][:1] == ["ok"]
    assert "".join(e.data["text"] for e in seen if e.type == "text") == "Writing it.Written."
    assert kinds[-1] == "end" and seen[-1].data["status"] == "succeeded"


def test_charlie_watch_of_a_failed_task_exits_1_and_resumes_after_an_offset(
    cluster: Cluster, script: Any
) -> None:
    model, _ = script(
        [
            {"say": "First words.", "tool_calls": [{"id": "l", "name": "list_files"}]},
            {"raise": "the model broke"},
        ]
    )
    task_id = charlie.submit("fail late", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.FAILED
    every = list(charlie.events(task_id))

    def watch(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "charlie", "watch", task_id, *more],
            cwd=REPO,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=120,
        )

    whole = watch("--offsets")
    assert whole.returncode == 1, whole.stdout + whole.stderr  # as `charlie wait`
    assert "First words." in whole.stdout and "failed:" in whole.stdout
    assert f"@{every[0].offset}" in whole.stdout
    # resumed after the first turn's text: only what followed it
    text_at = next(i for i, e in enumerate(every) if e.type == "text")
    rest = watch("--after", every[text_at].offset)
    assert rest.returncode == 1
    assert "First words." not in rest.stdout and "failed:" in rest.stdout
    assert "list_files" in rest.stdout  # the tool call came after the text


def test_each_call_settles_once_in_the_stream_and_an_event_delivered_twice_is_dropped(
    cluster: Cluster, script: Any
) -> None:
    """A local call settled inline is committed by the await tick's transaction: that tick's
    events and the settle's own report both told its ``tool_settled`` (I12: a call settles
    once; I28). Two local calls at once: one settled in a commit of its own, the last in the
    tick's. Every event has an id, and a reader drops one delivered again (at-least-once)."""
    model, _ = script(
        [
            {
                "say": "Looking twice.",
                "tool_calls": [
                    {"id": "l1", "name": "list_files"},
                    {"id": "l2", "name": "list_files"},
                ],
            },
            {"say": "Looked.", "tool_calls": [{"id": "l3", "name": "list_files"}]},
            {"say": "Done looking.", "tool_calls": []},
        ]
    )
    task_id = charlie.submit("look", model=model)
    seen = list(charlie.events(task_id, timeout=150))
    assert seen[-1].type == "end" and seen[-1].data["status"] == "succeeded"
    settled = sorted(e.data["call_id"] for e in seen if e.type == "tool_settled")
    assert settled == ["l1", "l2", "l3"]
    ids = [e.data.get("id") for e in seen[:-1]]  # (the end from the record may have none)
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)

    # the transport delivers a settle and the end again: a reader keeps one of each
    transport = charlie.api.get_producer().streams
    assert transport is not None
    again = [e.data for e in seen if e.type in ("tool_settled", "end")]
    transport.append(task_id, again)
    deadline = time.monotonic() + 30
    while len(list(charlie.api.get_producer().streams.read(task_id, None, 0.0))) < len(seen) + 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    reread = list(charlie.events(task_id))
    assert [e.data.get("id") for e in reread] == [e.data.get("id") for e in seen]


def test_charlie_watch_waits_for_a_task_not_created_yet_as_wait_does(
    cluster: Cluster, script: Any
) -> None:
    """A watcher started before the producer's submit crossed the broker follows the task
    once it appears; one whose task never appears stops at its timeout, saying so."""
    model, _ = script([{"say": "Here at last.", "tool_calls": []}])
    task_id = f"watched-early-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "charlie", "watch", task_id, "--timeout", "120"],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        waiting = proc.stderr.readline()  # said before the task exists
        assert f"no task {task_id} yet; waiting up to 120 s" in waiting, waiting
        assert proc.poll() is None
        charlie.submit("arrive", model=model, task_id=task_id)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "Here at last." in out and "succeeded:" in out

    never = subprocess.run(
        [sys.executable, "-m", "charlie", "watch", f"never-{task_id}", "--timeout", "1.5"],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert never.returncode == 2
    assert f"no task with id 'never-{task_id}': it was not created within 1.5 s" in never.stderr


def test_a_turn_holding_500_calls_streams_its_wait_and_what_follows(
    cluster: Cluster, script: Any
) -> None:
    """A turn whose 500 calls all wait for a person (100 approvals, 400 questions of 3,000
    characters): its ``waiting`` event would be 1.3 MB, longer than a file reader's chunk, and
    stalled every reader of the task for good. Now it is told in parts within the line bound,
    and a reader gets every held call, then the verdict and the end after it. The file
    transport's (Redis and RabbitMQ take an entry of any length)."""
    from tests.conftest import BACKEND

    if BACKEND.broker_url:
        pytest.skip("the file stream is the embedded default's")
    question = "Which way? " + "x" * 2990
    calls = [
        {"id": f"a{i}", "name": "ledger_write", "arguments": {"key": f"held-{i}"}}
        if i % 5 == 0
        else {"id": f"q{i}", "name": "ask_human", "arguments": {"question": question}}
        for i in range(500)
    ]
    model, _ = script([{"say": "Asking.", "tool_calls": calls}, {"say": "Done."}])
    task_id = charlie.submit("hold 500 calls", model=model, approve=["ledger_write"])
    wait_for(lambda: len(charlie.get_task(task_id).waiting_for or []) == 500, timeout=120)

    # The worker tells the wait after its commit, from its writer thread; the verdict is told by
    # this process: the approval waits until the whole wait has been told, so the order the
    # reader checks is the order things happened in, not a race between two writers.
    def told_held() -> int:
        told = charlie.events(task_id, follow=False)
        return sum(len(e.data["calls"]) for e in told if e.type == "waiting")

    wait_for(lambda: told_held() == 500, timeout=120)
    charlie.approve(task_id, "a0")
    charlie.cancel(task_id)
    seen = list(charlie.events(task_id, timeout=120))
    held = [c["call_id"] for e in seen if e.type == "waiting" for c in e.data["calls"]]
    assert sorted(held) == sorted(c["id"] for c in calls)
    kinds = [e.type for e in seen]
    assert "verdict" in kinds and kinds.index("waiting") < kinds.index("verdict")
    (verdict,) = [e.data for e in seen if e.type == "verdict"]
    assert (verdict["call_id"], verdict["action"]) == ("a0", "approve")
    assert kinds[-1] == "end" and seen[-1].data["status"] == "canceled"


def test_a_watcher_of_a_resumed_task_follows_it_to_its_real_end(
    cluster: Cluster, script: Any, tmp_path: Path
) -> None:
    """I28 after a resume: the first life's ``end`` is not the task's end. charlie.events from
    the start (``after=None``), the console's live panel (what it reads) and `charlie watch`
    go past it, as ``resumed``, to the resumed run's own events and its real end."""
    from charlie.console.server import load_events

    fault = tmp_path / "model-down"
    fault.write_text("down")
    model, _ = script(
        [
            {"say": "First life.", "tool_calls": [{"id": "l", "name": "list_files"}]},
            {"raise": "the model is down", "raise_while": str(fault), "say": "Second life."},
        ]
    )
    task_id = charlie.submit("fail, then resume", model=model)
    assert charlie.wait(task_id, timeout=60).status is TaskStatus.FAILED
    fault.unlink()
    charlie.resume(task_id)
    seen = list(charlie.events(task_id, timeout=60))
    kinds = [e.type for e in seen]
    assert kinds.count("end") == 1 and kinds[-1] == "end", kinds
    assert seen[-1].data["status"] == "succeeded"
    assert kinds.count("resumed") == 1
    assert "final" in kinds[kinds.index("resumed") :]
    assert "".join(e.data["text"] for e in seen if e.type == "text") == "First life.Second life."
    # the console's panel reads what is there now, and is told the same
    panel = load_events(task_id, None)["events"]
    assert [e["type"] for e in panel] == kinds
    watched = subprocess.run(
        [sys.executable, "-m", "charlie", "watch", task_id],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "Second life." in watched.stdout and "resumed" in watched.stdout
    # a fork is a task of its own: its watcher follows its own stream to its own end
    fork_id = charlie.fork(task_id, turn=0)
    forked = list(charlie.events(fork_id, timeout=60))
    assert [e.type for e in forked].count("end") == 1 and forked[-1].type == "end"
    assert forked[-1].data["status"] == "succeeded" and "resumed" not in [e.type for e in forked]


def test_a_queued_call_is_told_started_when_its_start_is_recorded_not_at_dispatch(
    cluster: Cluster, script: Any
) -> None:
    """I9, I28: calls queued that no one has started yet (the worker that starts them pauses
    before: a tool worker before its claim, or the dispatching worker before the commit that
    starts the turn's local writes) are not shown started; the commit that starts each tells
    it, once."""
    task_id = f"told-{uuid.uuid4().hex}"
    pause = {"action": "pause", "seconds": 5, "times": 1}
    points = ("tool.before_claim", "tick.merged.before_start")
    cluster.set_faults(
        {
            points[0]: {**pause, "match": {"task_id": task_id, "mode": "start"}},
            points[1]: {**pause, "match": {"task_id": task_id}},
        }
    )
    model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "a", "name": "ledger_write", "arguments": {"key": "told-a"}},
                    {"id": "b", "name": "ledger_write", "arguments": {"key": "told-b"}},
                ]
            },
            {"say": "both written"},
        ]
    )
    charlie.submit("two writes", model=model, task_id=task_id)
    wait_for(lambda: any(cluster.fault_count(p) for p in points), timeout=60)
    told = [e for e in charlie.events(task_id, follow=False) if e.type == "tool_started"]
    calls = {c.call_id: c for c in charlie.calls(task_id)}
    for event in told:  # each told after its start was recorded
        assert calls[event.data["call_id"]].started_at is not None, (event, calls)
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    told = [e for e in charlie.events(task_id) if e.type == "tool_started"]
    assert sorted(e.data["call_id"] for e in told) == ["a", "b"]
