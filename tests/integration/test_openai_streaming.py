"""The OpenAI clients stream (I16, I28): deltas go to ``request.deltas`` while the model writes,
and the answer is still built from the whole stream, once; a stream cut or stalled mid-way is a
transient failure, retried, never an answer. Against a real HTTP server on 127.0.0.1 that speaks
both server-sent event formats (tests/support/fake_openai.py)."""

from __future__ import annotations

import json
import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from charlie.domain import Item, ItemKind
from charlie.models.base import ModelRequest, ToolSpec, TransientModelError
from charlie.models.openai import client_for

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.support.fake_openai import (  # noqa: E402
    FakeOpenAI,
    chat_stream,
    chat_text,
    function_call_item,
    message_item,
    reasoning_item,
    responses_stream,
    usage_chat,
    usage_responses,
)

KEY = "sk-test-stream-Zq9xK3vL0pW7mN2bR5tY8"
TOOLS = [ToolSpec("grep", "Search.", {"type": "object", "properties": {"q": {"type": "string"}}})]


class Recorder:
    """A Deltas that records what it was sent, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.first = threading.Event()

    def text(self, delta: str) -> None:
        self.log.append(("text", delta))
        self.first.set()

    def reasoning(self, delta: str) -> None:
        self.log.append(("reasoning", delta))

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        self.log.append(("tool", (call_id, name, arguments_delta)))
        self.first.set()

    def restart(self, reason: str) -> None:
        self.log.append(("restart", reason))

    def joined(self, kind: str) -> str:
        return "".join(v for k, v in self.log if k == kind)


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch, fake: FakeOpenAI) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CHARLIE_MODEL") or name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CHARLIE_MODEL_BASE_URL", fake.url)
    monkeypatch.setenv("CHARLIE_MODEL_API_KEY", KEY)


def make(spec: str, **environ: str) -> Any:
    import os

    provider, _, name = spec.partition(":")
    env = {**os.environ, **environ}
    return client_for(provider, name, spec, environ=env, backoff_base=0.01, rng=random.Random(3))


def request(deltas: Any) -> ModelRequest:
    items = [Item(1, 0, ItemKind.INPUT, None, {"role": "user", "content": "Go."})]
    return ModelRequest("task-1", "x-task-1", 0, items, list(TOOLS), deltas=deltas)


def test_chat_streams_text_and_tool_arguments_and_answers_from_the_whole_stream(
    fake: FakeOpenAI,
) -> None:
    fake.enqueue(
        chat_stream(
            "Looking into it.",
            [("call_a", "grep", '{"q": "needle"}'), ("call_b", "grep", '{"q": "hay"}')],
            reasoning="Think first.",
            usage=usage_chat(12, 7, 3),
        )
    )
    deltas = Recorder()
    answer = make("openai:gpt-x").complete(request(deltas))
    body = fake.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert deltas.joined("text") == "Looking into it."
    assert deltas.joined("reasoning") == "Think first."
    pieces = [v for k, v in deltas.log if k == "tool"]
    assert "".join(p[2] for p in pieces if p[0] == "call_a") == '{"q": "needle"}'
    assert "".join(p[2] for p in pieces if p[0] == "call_b") == '{"q": "hay"}'
    assert len([k for k, _ in deltas.log if k == "text"]) > 1  # it came in pieces
    kinds = [i.kind for i in answer.output]
    assert kinds == [ItemKind.REASONING, ItemKind.MESSAGE, ItemKind.TOOL_CALL, ItemKind.TOOL_CALL]
    assert answer.output[1].payload["content"] == "Looking into it."
    assert answer.output[2].payload["arguments"] == {"q": "needle"}
    assert answer.output[3].call_id == "call_b"
    assert answer.finish_reason == "tool_calls"
    assert answer.usage.as_dict() == {
        "input_tokens": 12,
        "output_tokens": 7,
        "reasoning_tokens": 3,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }


def test_responses_streams_and_answers_from_response_completed(fake: FakeOpenAI) -> None:
    output = [
        reasoning_item("rs_1", "Plan it."),
        message_item("msg_1", "Here goes."),
        function_call_item("fc_1", "call_z", "grep", '{"q": "x"}'),
    ]
    fake.enqueue(responses_stream(output, usage=usage_responses(20, 9, 4)))
    deltas = Recorder()
    answer = make("openai-responses:gpt-x").complete(request(deltas))
    assert fake.bodies[0]["stream"] is True
    assert deltas.joined("text") == "Here goes."
    assert deltas.joined("reasoning") == "Plan it."
    tool = [v for k, v in deltas.log if k == "tool"]
    assert {(c, n) for c, n, _ in tool} == {("call_z", "grep")}
    assert "".join(p for _, _, p in tool) == '{"q": "x"}'
    # the answer is response.completed's response, whole: the reasoning item's encrypted
    # content (never streamed as a delta) is there for the next turn
    assert answer.output[0].payload["raw"]["encrypted_content"] == "gAAAA-opaque"
    assert answer.output[2].payload["arguments"] == {"q": "x"}
    assert answer.usage.output_tokens == 9


@pytest.mark.parametrize("spec", ["openai:gpt-x", "openai-responses:gpt-x"])
def test_a_stream_cut_mid_way_is_retried_never_an_answer(fake: FakeOpenAI, spec: str) -> None:
    chat = spec.startswith("openai:")
    full = "The whole answer, not a part of it."
    whole = chat_stream(full) if chat else responses_stream([message_item("m", full)])
    cut = (
        chat_stream(full, cut_at=4)
        if chat
        else responses_stream([message_item("m", full)], cut_at=4)
    )
    fake.enqueue(cut, whole)
    deltas = Recorder()
    answer = make(spec).complete(request(deltas))
    assert len(fake.requests) == 2
    assert answer.output[-1].payload["content"] == full  # never the cut one's part
    restart = [i for i, (k, _) in enumerate(deltas.log) if k == "restart"]
    assert len(restart) == 1
    after = "".join(v for k, v in deltas.log[restart[0] + 1 :] if k == "text")
    assert after == full


def test_a_stream_that_ends_without_its_end_is_transient(fake: FakeOpenAI) -> None:
    reply = chat_stream("half")
    assert reply.events is not None
    reply.events = reply.events[:-3]  # no finish, no usage, no [DONE]: a clean close too early
    fake.enqueue(reply)
    with pytest.raises(TransientModelError, match="ended before it was complete"):
        make("openai:gpt-x", CHARLIE_MODEL_MAX_ATTEMPTS="1").complete(request(Recorder()))


def test_a_stalled_stream_times_out_as_transient(fake: FakeOpenAI) -> None:
    fake.enqueue(chat_stream("slow words", hold_at=3, hold_seconds=5))
    deltas = Recorder()
    with pytest.raises(TransientModelError, match="stalled"):
        make("openai:gpt-x", CHARLIE_MODEL_MAX_ATTEMPTS="1", CHARLIE_MODEL_TIMEOUT="0.5").complete(
            request(deltas)
        )
    assert deltas.joined("text")  # it had started


def test_an_error_event_in_the_stream_is_a_failure_with_the_key_redacted(fake: FakeOpenAI) -> None:
    reply = responses_stream([message_item("m", "abc")])
    assert reply.events is not None
    error = {"type": "error", "code": "server_error", "message": f"oops with {KEY}"}
    reply.events = [*reply.events[:2], f"event: error\ndata: {json.dumps(error)}\n\n"]
    fake.enqueue(reply)
    with pytest.raises(TransientModelError) as caught:
        make("openai-responses:gpt-x", CHARLIE_MODEL_MAX_ATTEMPTS="1").complete(request(Recorder()))
    assert KEY not in str(caught.value) and KEY not in json.dumps(caught.value.evidence)


def test_no_watcher_no_stream_and_a_json_answer_to_a_stream_request_is_read(
    fake: FakeOpenAI,
) -> None:
    fake.enqueue(chat_text("plain"), chat_text("json anyway"))
    model = make("openai:gpt-x")
    items = [Item(1, 0, ItemKind.INPUT, None, {"role": "user", "content": "Go."})]
    plain = model.complete(ModelRequest("t", "x-t", 0, items, []))
    assert "stream" not in fake.bodies[0]
    assert plain.output[-1].payload["content"] == "plain"
    # a compatible server that ignores stream: true and answers JSON is still understood
    answer = model.complete(request(Recorder()))
    assert fake.bodies[1]["stream"] is True
    assert answer.output[-1].payload["content"] == "json anyway"
