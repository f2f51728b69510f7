"""The ``anthropic:`` client (the official SDK, streamed) against a real HTTP server on
127.0.0.1 that speaks the Messages API (tests/support/fake_anthropic.py)."""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from charlie.domain import Item, ItemKind, NewItem
from charlie.models.anthropic import MAX_CONTINUATIONS, client_for
from charlie.models.base import ModelError, ModelRequest, ToolSpec, TransientModelError
from charlie.models.resolve import resolve_model

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.support.fake_anthropic import (  # noqa: E402
    FakeAnthropic,
    Reply,
    broken,
    error,
    message,
    overloaded,
    rate_limited,
    redacted_thinking,
    text,
    thinking,
    tool_use,
    usage,
)

KEY = "sk-ant-test-Hq3zV8nL1mP0wR6sT9yU2iO5aE7dF4gJ"
TOOLS = [
    ToolSpec(
        "read_file",
        "Read a file.",
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
    ToolSpec("grep", "Search.", {"type": "object", "properties": {"pattern": {"type": "string"}}}),
]


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    server = FakeAnthropic(key=KEY).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch, fake: FakeAnthropic) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(("CHARLIE_MODEL", "ANTHROPIC_")) or name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    return monkeypatch


_made: list[Any] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def make(name: str = "claude-test", **options: Any) -> Any:
    options.setdefault("backoff_base", 0.01)
    options.setdefault("rng", random.Random(7))
    model = client_for(name, f"anthropic:{name}", **options)
    _made.append(model)
    return model


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def text(self, delta: str) -> None:
        self.seen.append(("text", delta))

    def reasoning(self, delta: str) -> None:
        self.seen.append(("reasoning", delta))

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        self.seen.append(("tool_call", (call_id, name, arguments_delta)))


def context() -> list[Item]:
    return [
        Item(1, 0, ItemKind.INPUT, None, {"role": "system", "content": "You are Charlie."}),
        Item(2, 0, ItemKind.INPUT, None, {"role": "user", "content": "Fix the bug."}),
    ]


def request(items: list[Item] | None = None, turn: int = 0, deltas: Any = None) -> ModelRequest:
    extra = {"deltas": deltas} if deltas is not None else {}
    return ModelRequest(
        task_id="task-1",
        execution_id="exec-1",
        turn=turn,
        items=items if items is not None else context(),
        tools=list(TOOLS),
        **extra,
    )


def committed(items: list[Item], output: list[NewItem], turn: int) -> list[Item]:
    """The transcript after a turn's output is committed (as the executor writes it)."""
    seq = items[-1].seq
    out = list(items)
    for new in output:
        seq += 1
        out.append(Item(seq, turn, new.kind, new.call_id, new.payload))
    return out


def result(seq: int, turn: int, call_id: str, content: str, outcome: str = "ok") -> Item:
    return Item(
        seq,
        turn,
        ItemKind.TOOL_RESULT,
        call_id,
        {"name": "read_file", "outcome": outcome, "result": content, "content": content},
    )


def test_a_tool_loop_with_parallel_calls_and_thinking_replays_the_signed_blocks(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thinking and redacted_thinking blocks come back unchanged, signatures included, first in
    the assistant turn; every parallel call is answered in ONE user turn, in call order, a
    failed one with is_error (the fake refuses the loop otherwise, as the API does)."""
    monkeypatch.setenv("CHARLIE_MODEL_CLAUDE_TEST_THINKING_BUDGET", "2048")
    fake.enqueue(
        message(
            thinking("I should read both files.", "sig-AAA"),
            redacted_thinking("opaque-XYZ"),
            text("Reading."),
            tool_use("toolu_1", "read_file", {"path": "a.txt"}),
            tool_use("toolu_2", "read_file", '{"path": "b.txt"}'),
            use=usage(100, 40, cache_write=900, thinking_tokens=25),
        ),
        message(text("Both read."), use=usage(20, 5, cache_read=900)),
    )
    model = make()
    watcher = Recorder()
    first = model.complete(request(deltas=watcher))
    kinds = [i.kind for i in first.output]
    assert kinds == [
        ItemKind.REASONING,
        ItemKind.REASONING,
        ItemKind.MESSAGE,
        ItemKind.TOOL_CALL,
        ItemKind.TOOL_CALL,
    ]
    assert first.output[0].payload["summary"] == "I should read both files."
    assert first.output[0].payload["raw"]["signature"] == "sig-AAA"
    assert [c.call_id for c in first.tool_calls] == ["toolu_1", "toolu_2"]
    assert first.tool_calls[1].payload["raw_arguments"] == '{"path": "b.txt"}'
    assert first.finish_reason == "tool_use"
    assert first.usage.as_dict() == {
        "input_tokens": 1000,
        "output_tokens": 40,
        "reasoning_tokens": 25,
        "cache_read_tokens": 0,
        "cache_write_tokens": 900,
    }
    # the deltas arrived as the model wrote (I16: they are not the answer)
    assert "".join(d for k, d in watcher.seen if k == "reasoning") == "I should read both files."
    assert "".join(d for k, d in watcher.seen if k == "text") == "Reading."
    streamed = [d for k, d in watcher.seen if k == "tool_call"]
    assert streamed[0] == ("toolu_1", "read_file", "")
    assert "".join(a for c, _, a in streamed if c == "toolu_2") == '{"path": "b.txt"}'

    items = committed(context(), first.output, 0)
    items += [
        result(items[-1].seq + 2, 0, "toolu_2", "", outcome="error"),  # answered out of order
        result(items[-1].seq + 1, 0, "toolu_1", "alpha"),
    ]
    second = model.complete(request(items, turn=1))
    assert second.output[0].payload["content"] == "Both read."
    assert second.usage.cache_read_tokens == 900 and second.usage.input_tokens == 920

    body = fake.bodies[1]
    headers = fake.requests[1].headers
    assert KEY in (headers.get("x-api-key"), headers.get("authorization", "")[7:])
    assert headers["anthropic-version"]
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert body["max_tokens"] == 8192 + 2048
    assert body["stream"] is True
    assert body["system"][0]["text"] == "You are Charlie."
    assistant = body["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"][:2] == [
        {"type": "thinking", "thinking": "I should read both files.", "signature": "sig-AAA"},
        {"type": "redacted_thinking", "data": "opaque-XYZ"},
    ]
    assert [b["type"] for b in assistant["content"][2:]] == ["text", "tool_use", "tool_use"]
    answers = body["messages"][2]["content"]
    assert [(b["tool_use_id"], b.get("is_error", False)) for b in answers] == [
        ("toolu_1", False),
        ("toolu_2", True),
    ]
    # prompt caching: the last tool, the system prompt, and the user turns (at most 4)
    assert "cache_control" in body["tools"][-1]
    assert "cache_control" in body["system"][-1]
    assert "cache_control" in answers[-1]
    assert "cache_control" in body["messages"][0]["content"][-1]
    marks = json.dumps(body).count('"cache_control"')
    assert marks == 4


def test_a_tool_loop_that_drops_the_signed_thinking_is_refused_by_the_fake(
    fake: FakeAnthropic,
) -> None:
    """The fake enforces the API's rule (so the test above proves the replay)."""
    fake.enqueue(
        message(thinking("hmm", "sig-1"), tool_use("toolu_9", "grep", {"pattern": "x"})),
    )
    model = make()
    first = model.complete(request())
    stripped = [i for i in first.output if i.kind is not ItemKind.REASONING]
    items = committed(context(), stripped, 0)
    items.append(result(items[-1].seq + 1, 0, "toolu_9", "none"))
    with pytest.raises(ModelError) as refused:
        model.complete(request(items, turn=1))
    assert refused.value.evidence["status"] == 400
    assert "thinking" in refused.value.evidence["body"]


def test_overloaded_529_then_success_honours_retry_after(fake: FakeAnthropic) -> None:
    slept: list[float] = []
    fake.enqueue(overloaded(retry_after="1"), message(text("ok")))
    answer = make(sleep=slept.append).complete(request())
    assert answer.output[0].payload["content"] == "ok"
    assert slept == [1.0]
    assert len(fake.requests) == 2


def test_a_long_retry_after_on_429_is_handed_to_the_executor(fake: FakeAnthropic) -> None:
    fake.enqueue(rate_limited(retry_after="300"))
    with pytest.raises(TransientModelError) as raised:
        make(sleep=lambda s: pytest.fail("slept in the call")).complete(request())
    assert raised.value.retry_after == 300
    assert raised.value.evidence["status"] == 429
    assert len(fake.requests) == 1


def test_an_error_event_in_the_stream_and_a_broken_stream_are_retried(
    fake: FakeAnthropic,
) -> None:
    """I16: a stream that breaks is never a partial answer; the call is tried again."""
    fake.enqueue(
        Reply(content=[text("lost")], error_event="overloaded_error"),
        broken(message(text("half an answer that is lost")), after=5),
        message(text("whole answer")),
    )
    slept: list[float] = []
    answer = make(sleep=slept.append).complete(request())
    assert [i.payload["content"] for i in answer.output] == ["whole answer"]
    assert len(fake.requests) == 3 and len(slept) == 2


def test_a_400_fails_with_the_response_as_evidence(fake: FakeAnthropic) -> None:
    fake.enqueue(error(400, "invalid_request_error", "messages.0: bad thing"))
    with pytest.raises(ModelError) as raised:
        make().complete(request())
    assert "HTTP 400 invalid_request_error: messages.0: bad thing" in str(raised.value)
    assert raised.value.evidence["status"] == 400
    assert json.loads(raised.value.evidence["body"])["error"]["type"] == "invalid_request_error"
    assert len(fake.requests) == 1


def test_a_refusal_fails_with_the_message_as_evidence_and_is_not_retried(
    fake: FakeAnthropic,
) -> None:
    fake.enqueue(message(text("I can't help with that."), stop_reason="refusal"))
    with pytest.raises(ModelError) as raised:
        make().complete(request())
    assert "refused" in str(raised.value) and "I can't help with that." in str(raised.value)
    assert "I can't help" in raised.value.evidence["body"]
    assert len(fake.requests) == 1


def test_max_tokens_fails_naming_the_setting(fake: FakeAnthropic) -> None:
    fake.enqueue(message(text("The answer is"), stop_reason="max_tokens"))
    with pytest.raises(ModelError, match="CHARLIE_MODEL_CLAUDE_TEST_MAX_TOKENS") as raised:
        make().complete(request())
    assert "The answer is" in raised.value.evidence["body"]


def test_pause_turn_continues_the_turn_within_the_call(fake: FakeAnthropic) -> None:
    fake.enqueue(
        message(text("Searching first."), stop_reason="pause_turn", use=usage(10, 3)),
        message(text("Found it."), use=usage(30, 4)),
    )
    answer = make().complete(request())
    assert [i.payload["content"] for i in answer.output] == ["Searching first.", "Found it."]
    assert answer.usage.input_tokens == 40 and answer.usage.output_tokens == 7
    continued = fake.bodies[1]["messages"]
    assert continued[-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Searching first."}],
    }
    assert continued[:-1] == fake.bodies[0]["messages"]


def test_pause_turn_is_bounded(fake: FakeAnthropic) -> None:
    paused = [message(text(f"part {i}"), stop_reason="pause_turn") for i in range(9)]
    assert len(paused) == MAX_CONTINUATIONS + 1
    fake.enqueue(*paused)
    with pytest.raises(ModelError, match="pause_turn"):
        make().complete(request())
    assert len(fake.requests) == MAX_CONTINUATIONS + 1


def test_the_key_goes_only_to_its_own_host_and_never_into_errors_or_logs(
    fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.enqueue(error(401, "authentication_error", f"invalid x-api-key {KEY}"))
    with pytest.raises(ModelError) as raised:
        make().complete(request())
    assert KEY not in str(raised.value) and KEY not in json.dumps(raised.value.evidence)
    assert "[REDACTED]" in raised.value.evidence["body"]
    assert KEY not in caplog.text
    for record in caplog.records:
        assert KEY not in repr(record.__dict__)
    # a model sent to another host does not get ANTHROPIC_API_KEY
    monkeypatch.setenv("CHARLIE_MODEL_ELSEWHERE_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(ModelError, match="no API key") as no_key:
        make("elsewhere").complete(request())
    assert KEY not in str(no_key.value)
    monkeypatch.setenv("CHARLIE_MODEL_ELSEWHERE_API_KEY", "sk-own")
    assert make("elsewhere").config.api_key == "sk-own"


def test_resolve_model_knows_anthropic(fake: FakeAnthropic) -> None:
    fake.enqueue(message(text("hi")))
    model = resolve_model("anthropic:claude-test")
    _made.append(model)
    assert model.complete(request()).output[0].payload["content"] == "hi"
