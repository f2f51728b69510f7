"""The OpenAI clients against a real HTTP server on 127.0.0.1 (tests/support/fake_openai.py)."""

from __future__ import annotations

import json
import logging
import random
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest

from charlie.domain import Item, ItemKind, NewItem
from charlie.models.base import (
    ModelError,
    ModelRequest,
    ToolSpec,
    TransientModelError,
    tool_call_item,
)
from charlie.models.openai import OpenAIChatModel, OpenAIResponsesModel, client_for
from charlie.models.resolve import resolve_model

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # tests/ is not a package; make tests.support importable anyway
    sys.path.insert(0, ROOT)

from tests.support.fake_openai import (  # noqa: E402
    FakeOpenAI,
    Reply,
    chat_text,
    chat_tool_calls,
    context_length_error,
    echoing_auth,
    empty_choices,
    error,
    function_call_item,
    message_item,
    rate_limited,
    reasoning_item,
    response,
    server_error,
    slow,
    usage_chat,
    usage_responses,
)

KEY = "sk-test-Zq9xK3vL0pW7mN2bR5tY8uI1oE4aS6dF"
TOOLS = [
    ToolSpec(
        "read_file",
        "Read a file from the workspace.",
        {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    ),
    ToolSpec(
        "grep",
        "Search files.",
        {"type": "object", "properties": {"pattern": {"type": "string"}}},
    ),
]
EXPECTED_CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search files.",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    },
]


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch, fake: FakeOpenAI) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("CHARLIE_MODEL") or name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CHARLIE_MODEL_BASE_URL", fake.url)
    monkeypatch.setenv("CHARLIE_MODEL_API_KEY", KEY)
    return monkeypatch


_made: list[Any] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def make(spec: str, **options: Any) -> Any:
    provider, _, name = spec.partition(":")
    options.setdefault("backoff_base", 0.01)
    options.setdefault("rng", random.Random(7))
    model = client_for(provider, name, spec, **options)
    _made.append(model)
    return model


def request(items: list[Item] | None = None, turn: int = 0, tools: bool = True) -> ModelRequest:
    return ModelRequest(
        task_id="task-1",
        execution_id="exec-1",
        turn=turn,
        items=items if items is not None else context(),
        tools=list(TOOLS) if tools else [],
    )


def context() -> list[Item]:
    return [
        Item(1, 0, ItemKind.INPUT, None, {"role": "system", "content": "You are Charlie."}),
        Item(2, 0, ItemKind.INPUT, None, {"role": "user", "content": "Fix the bug."}),
    ]


def committed(start: int, turn: int, items: list[NewItem]) -> list[Item]:
    """New items as the executor would commit them."""
    return [
        Item(start + n, turn, item.kind, item.call_id, item.payload) for n, item in enumerate(items)
    ]


def result(seq: int, turn: int, call_id: str, name: str, content: str) -> Item:
    return Item(
        seq,
        turn,
        ItemKind.TOOL_RESULT,
        call_id,
        {"name": name, "outcome": "ok", "result": content, "content": content},
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- configuration ---------------------------------------------------------------------------


def test_client_for_picks_the_api_and_reads_the_environment(fake: FakeOpenAI) -> None:
    chat = make("openai:gpt-4.1-mini")
    responses = make("openai-responses:o4-mini")
    assert isinstance(chat, OpenAIChatModel) and chat.spec == "openai:gpt-4.1-mini"
    assert (
        isinstance(responses, OpenAIResponsesModel) and responses.spec == "openai-responses:o4-mini"
    )
    assert chat.config.base_url == fake.url
    assert chat.config.read_timeout == 120 and chat.config.connect_timeout == 10
    assert chat.config.max_attempts == 5
    assert KEY not in repr(chat) and KEY not in repr(chat.config)
    resolved = resolve_model("openai-responses:o4-mini")
    assert isinstance(resolved, OpenAIResponsesModel)
    _made.append(resolved)


def test_per_model_overrides_win(fake: FakeOpenAI, env: pytest.MonkeyPatch) -> None:
    env.setenv("CHARLIE_MODEL_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    env.setenv("CHARLIE_MODEL_GPT_4_1_MINI_BASE_URL", fake.url + "/")
    env.setenv("CHARLIE_MODEL_GPT_4_1_MINI_API_KEY", "sk-per-model")
    fake.enqueue(chat_text("hi"))
    make("openai:gpt-4.1-mini").complete(request())
    assert fake.requests[0].path == "/v1/chat/completions"
    assert fake.requests[0].headers["authorization"] == "Bearer sk-per-model"


def test_the_shared_key_never_goes_to_a_models_own_host(
    fake: FakeOpenAI, env: pytest.MonkeyPatch
) -> None:
    # CHARLIE_MODEL_API_KEY belongs to CHARLIE_MODEL_BASE_URL. A model whose
    # own base URL is another host must not receive it (it would hand the key to that host).
    shared = FakeOpenAI().start()
    try:
        env.setenv("CHARLIE_MODEL_BASE_URL", shared.url)
        env.setenv("CHARLIE_MODEL_LOCAL_LLAMA_BASE_URL", fake.url)
        fake.enqueue(chat_text("hi"))
        make("openai:local-llama").complete(request())
        assert "authorization" not in fake.requests[0].headers
        # its own key goes to its own host
        env.setenv("CHARLIE_MODEL_LOCAL_LLAMA_API_KEY", "sk-local")
        fake.enqueue(chat_text("hi"))
        make("openai:local-llama").complete(request())
        assert fake.requests[1].headers["authorization"] == "Bearer sk-local"
        # the shared key still goes to the shared host, and to a per-model URL on that origin
        env.setenv("CHARLIE_MODEL_OTHER_BASE_URL", shared.url + "/")
        shared.enqueue(chat_text("hi"))
        shared.enqueue(chat_text("hi"))
        make("openai:gpt-4.1").complete(request())
        make("openai:other").complete(request())
        assert [r.headers["authorization"] for r in shared.requests] == [f"Bearer {KEY}"] * 2
    finally:
        shared.stop()


def test_no_key_sends_no_authorization(fake: FakeOpenAI, env: pytest.MonkeyPatch) -> None:
    env.delenv("CHARLIE_MODEL_API_KEY")
    fake.enqueue(chat_text("hi"))
    make("openai:local-llama").complete(request())
    assert "authorization" not in fake.requests[0].headers


# -- Chat Completions ------------------------------------------------------------------------


def test_chat_text_answer_request_and_usage(fake: FakeOpenAI) -> None:
    fake.enqueue(chat_text("All done.", usage_chat(prompt=42, completion=7, reasoning=3)))
    answer = make("openai:gpt-4.1").complete(request())

    sent = fake.requests[0]
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.headers["content-type"] == "application/json"
    assert sent.body == {
        "model": "gpt-4.1",
        "messages": [
            {"role": "system", "content": "You are Charlie."},
            {"role": "user", "content": "Fix the bug."},
        ],
        "tools": EXPECTED_CHAT_TOOLS,
        "parallel_tool_calls": True,
    }
    assert answer.output == [
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "All done."})
    ]
    assert answer.tool_calls == []
    assert answer.usage.as_dict() == {
        "input_tokens": 42,
        "output_tokens": 7,
        "reasoning_tokens": 3,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }


def test_chat_without_tools_sends_no_tool_fields(fake: FakeOpenAI) -> None:
    fake.enqueue(chat_text("ok"))
    make("openai:gpt-4.1").complete(request(tools=False))
    assert set(fake.requests[0].body) == {"model", "messages"}


def test_chat_replays_the_transcript_and_maps_parallel_calls(fake: FakeOpenAI) -> None:
    turn0 = [
        NewItem(ItemKind.REASONING, {"summary": "think", "raw": None}),
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "Looking."}),
        tool_call_item("c1", "read_file", '{"path":  "a.py"}'),
        tool_call_item("c2", "grep", '{"pattern": "x",}'),
    ]
    items = [
        *context(),
        *committed(3, 0, turn0),
        # results committed in finish order, not call order
        result(7, 0, "c2", "grep", "ERROR: arguments are not valid JSON"),
        result(8, 0, "c1", "read_file", "print(1)"),
        *committed(9, 1, [tool_call_item("c3", "grep", "{}")]),
        result(10, 1, "c3", "grep", "a.py:1"),
    ]
    fake.enqueue(
        chat_tool_calls(
            [
                ("call_a", "read_file", '{"path": "b.py"}'),
                (None, "grep", '{"pattern": oops'),
            ],
            text="Two more things.",
        )
    )
    answer = make("openai:gpt-4.1").complete(request(items, turn=2))

    assert fake.requests[0].body["messages"] == [
        {"role": "system", "content": "You are Charlie."},
        {"role": "user", "content": "Fix the bug."},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path":  "a.py"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "grep", "arguments": '{"pattern": "x",}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "c2", "content": "ERROR: arguments are not valid JSON"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "a.py:1"},
    ]
    assert answer.output == [
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "Two more things."}),
        NewItem(
            ItemKind.TOOL_CALL,
            {
                "name": "read_file",
                "arguments": {"path": "b.py"},
                "raw_arguments": '{"path": "b.py"}',
            },
            call_id="call_a",
        ),
        NewItem(
            ItemKind.TOOL_CALL,
            {"name": "grep", "arguments": None, "raw_arguments": '{"pattern": oops'},
            call_id="call_1",
        ),
    ]


def test_chat_empty_choices_is_a_model_error(fake: FakeOpenAI) -> None:
    fake.enqueue(empty_choices())
    with pytest.raises(ModelError) as caught:
        make("openai:gpt-4.1").complete(request())
    assert caught.value.evidence["status"] == 200
    assert '"choices": []' in caught.value.evidence["body"]
    assert len(fake.requests) == 1


def test_chat_without_content_or_calls_is_a_model_error(fake: FakeOpenAI) -> None:
    fake.enqueue(chat_text(""))
    with pytest.raises(ModelError, match="neither content nor tool calls"):
        make("openai:gpt-4.1").complete(request())


def test_a_body_that_is_not_json_is_a_model_error(fake: FakeOpenAI) -> None:
    fake.enqueue(Reply(200, "<html>gateway</html>"))
    with pytest.raises(ModelError) as caught:
        make("openai:gpt-4.1").complete(request())
    assert caught.value.evidence == {"status": 200, "body": "<html>gateway</html>"}


# -- Responses -------------------------------------------------------------------------------


def test_responses_request_replays_reasoning_and_maps_output(fake: FakeOpenAI) -> None:
    rs1 = reasoning_item("rs_1", "Plan: read both files.", encrypted="enc-1")
    rs2 = reasoning_item("rs_2", None, encrypted="enc-2")
    msg1 = message_item("msg_1", "Both read.")
    turn0 = [
        NewItem(ItemKind.REASONING, {"summary": "Plan: read both files.", "raw": rs1}),
        tool_call_item("call_a", "read_file", '{"path": "a.py"}'),
        tool_call_item("call_b", "read_file", '{ "path" : "b.py" }'),
    ]
    turn1 = [
        NewItem(ItemKind.REASONING, {"summary": None, "raw": rs2}),
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "Both read.", "raw": msg1}),
    ]
    items = [
        *context(),
        *committed(3, 0, turn0),
        result(6, 0, "call_b", "read_file", "B"),
        result(7, 0, "call_a", "read_file", "A"),
        *committed(8, 1, turn1),
        Item(10, 1, ItemKind.INPUT, None, {"role": "user", "content": "Now fix it."}),
    ]
    rs3 = reasoning_item("rs_3", "Edit a.py.", encrypted="enc-3")
    msg2 = message_item("msg_2", "Editing.")
    fc1 = function_call_item("fc_1", "call_x", "grep", '{"pattern": "bug"}')
    fc2 = function_call_item("fc_2", None, "read_file", "not json")
    fake.enqueue(response([rs3, msg2, fc1, fc2], usage_responses(100, 20, 12)))

    answer = make("openai-responses:o4-mini").complete(request(items, turn=2))

    sent = fake.requests[0]
    assert sent.path == "/v1/responses"
    assert sent.body == {
        "model": "o4-mini",
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "parallel_tool_calls": True,
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": False,
            }
            for t in TOOLS
        ],
        "input": [
            {"role": "system", "content": "You are Charlie."},
            {"role": "user", "content": "Fix the bug."},
            {k: v for k, v in rs1.items() if k != "id"},
            {
                "type": "function_call",
                "call_id": "call_a",
                "name": "read_file",
                "arguments": '{"path": "a.py"}',
            },
            {
                "type": "function_call",
                "call_id": "call_b",
                "name": "read_file",
                "arguments": '{ "path" : "b.py" }',
            },
            {"type": "function_call_output", "call_id": "call_a", "output": "A"},
            {"type": "function_call_output", "call_id": "call_b", "output": "B"},
            {k: v for k, v in rs2.items() if k != "id"},
            {k: v for k, v in msg1.items() if k != "id"},
            {"role": "user", "content": "Now fix it."},
        ],
    }
    assert sent.body["input"][2]["encrypted_content"] == "enc-1"

    assert answer.output == [
        NewItem(ItemKind.REASONING, {"summary": "Edit a.py.", "raw": rs3}),
        NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": "Editing.", "raw": msg2}),
        NewItem(
            ItemKind.TOOL_CALL,
            {
                "name": "grep",
                "arguments": {"pattern": "bug"},
                "raw_arguments": '{"pattern": "bug"}',
            },
            call_id="call_x",
        ),
        NewItem(
            ItemKind.TOOL_CALL,
            {"name": "read_file", "arguments": None, "raw_arguments": "not json"},
            call_id="call_3",
        ),
    ]
    assert answer.usage.as_dict() == {
        "input_tokens": 100,
        "output_tokens": 20,
        "reasoning_tokens": 12,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }


def test_responses_round_trip_passes_reasoning_back(fake: FakeOpenAI) -> None:
    rs = reasoning_item("rs_9", "Need the file.", encrypted="opaque-blob")
    fc = function_call_item("fc_9", "call_9", "read_file", '{"path":"x"}')
    fake.enqueue(response([rs, fc]), response([message_item("msg_9", "It says hi.")]))
    model = make("openai-responses:gpt-5")

    first = model.complete(request())
    items = [
        *context(),
        *committed(3, 0, first.output),
        result(5, 0, "call_9", "read_file", "hi"),
    ]
    second = model.complete(request(items, turn=1))

    assert fake.requests[1].body["input"][2:] == [
        {"type": "reasoning", "summary": rs["summary"], "encrypted_content": "opaque-blob"},
        {
            "type": "function_call",
            "call_id": "call_9",
            "name": "read_file",
            "arguments": '{"path":"x"}',
        },
        {"type": "function_call_output", "call_id": "call_9", "output": "hi"},
    ]
    assert [i.payload["content"] for i in second.output] == ["It says hi."]


def test_responses_with_only_reasoning_is_a_model_error(fake: FakeOpenAI) -> None:
    fake.enqueue(response([reasoning_item("rs_1", "hmm")], status="incomplete"))
    with pytest.raises(ModelError, match="neither content nor tool calls") as caught:
        make("openai-responses:o4-mini").complete(request())
    assert '"rs_1"' in caught.value.evidence["body"]


# -- retries ---------------------------------------------------------------------------------


def test_429_honours_retry_after_then_succeeds(fake: FakeOpenAI) -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    fake.enqueue(rate_limited("0"), rate_limited("1"), chat_text("finally"))
    started = time.monotonic()
    answer = make("openai:gpt-4.1", sleep=sleep).complete(request())
    assert time.monotonic() - started >= 1.0
    assert sleeps == [0.0, 1.0]
    assert answer.output[0].payload["content"] == "finally"
    assert len(fake.requests) == 3
    assert fake.bodies[0] == fake.bodies[1] == fake.bodies[2]


def test_long_retry_after_is_handed_to_the_executor(fake: FakeOpenAI) -> None:
    fake.enqueue(rate_limited("120"))
    started = time.monotonic()
    with pytest.raises(TransientModelError) as caught:
        make("openai:gpt-4.1").complete(request())
    assert time.monotonic() - started < 1.0
    assert caught.value.retry_after == pytest.approx(120)
    assert caught.value.evidence["status"] == 429
    assert len(fake.requests) == 1


def test_retry_after_as_an_http_date(fake: FakeOpenAI) -> None:
    when = datetime.now(UTC) + timedelta(seconds=300)
    fake.enqueue(
        Reply(503, {"error": {"message": "busy"}}, {"Retry-After": format_datetime(when, True)})
    )
    with pytest.raises(TransientModelError) as caught:
        make("openai-responses:o4-mini").complete(request())
    assert caught.value.retry_after == pytest.approx(300, abs=3)


def test_500_then_success(fake: FakeOpenAI) -> None:
    sleeps: list[float] = []
    fake.enqueue(server_error(500), chat_text("recovered"))
    answer = make("openai:gpt-4.1", sleep=sleeps.append).complete(request())
    assert answer.output[0].payload["content"] == "recovered"
    assert len(fake.requests) == 2
    assert len(sleeps) == 1 and 0 <= sleeps[0] <= 0.01


def test_backoff_longer_than_max_sleep_is_handed_to_the_executor(fake: FakeOpenAI) -> None:
    fake.enqueue(server_error(502))
    with pytest.raises(TransientModelError) as caught:
        make("openai:gpt-4.1", backoff_base=30.0, max_sleep=5.0).complete(request())
    assert caught.value.retry_after is not None and 0 < caught.value.retry_after <= 30
    assert len(fake.requests) == 1


def test_attempts_are_bounded(fake: FakeOpenAI, env: pytest.MonkeyPatch) -> None:
    env.setenv("CHARLIE_MODEL_MAX_ATTEMPTS", "3")
    fake.enqueue(server_error(503), server_error(503), server_error(503), chat_text("late"))
    with pytest.raises(TransientModelError) as caught:
        make("openai:gpt-4.1").complete(request())
    assert len(fake.requests) == 3
    assert caught.value.retry_after is None
    assert caught.value.evidence["status"] == 503
    assert caught.value.evidence["attempts"] == 3
    # the count is the evidence's: the message is the provider's, so a view that says the
    # run's count beside it does not say a second, different one (I36)
    assert "attempts" not in str(caught.value) and "HTTP 503" in str(caught.value)


def test_slow_answer_times_out_and_is_retried(fake: FakeOpenAI, env: pytest.MonkeyPatch) -> None:
    env.setenv("CHARLIE_MODEL_TIMEOUT", "0.3")
    fake.enqueue(slow(chat_text("too late"), 1.0), chat_text("in time"))
    started = time.monotonic()
    answer = make("openai:gpt-4.1").complete(request())
    assert time.monotonic() - started < 0.9
    assert answer.output[0].payload["content"] == "in time"
    assert len(fake.requests) == 2


def test_timeouts_until_attempts_run_out(fake: FakeOpenAI, env: pytest.MonkeyPatch) -> None:
    env.setenv("CHARLIE_MODEL_TIMEOUT", "0.2")
    env.setenv("CHARLIE_MODEL_MAX_ATTEMPTS", "2")
    fake.enqueue(slow(chat_text("x"), 0.6), slow(chat_text("y"), 0.6))
    with pytest.raises(TransientModelError, match="timed out") as caught:
        make("openai-responses:o4-mini").complete(request())
    assert "ReadTimeout" in caught.value.evidence["error"]
    assert len(fake.requests) == 2


def test_connection_refused_is_transient(env: pytest.MonkeyPatch) -> None:
    env.setenv("CHARLIE_MODEL_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    env.setenv("CHARLIE_MODEL_MAX_ATTEMPTS", "2")
    with pytest.raises(TransientModelError, match="ConnectError"):
        make("openai:gpt-4.1").complete(request())


# -- errors that retrying will not fix -------------------------------------------------------


def test_400_context_length_is_a_model_error_without_retry(fake: FakeOpenAI) -> None:
    fake.enqueue(context_length_error(), chat_text("never sent"))
    with pytest.raises(ModelError, match="context length exceeded") as caught:
        make("openai:gpt-4.1").complete(request())
    assert not isinstance(caught.value, TransientModelError)
    assert caught.value.evidence["status"] == 400
    assert json.loads(caught.value.evidence["body"])["error"]["code"] == "context_length_exceeded"
    assert len(fake.requests) == 1


@pytest.mark.parametrize("status", [401, 403, 404, 413, 422])
def test_other_4xx_are_model_errors(fake: FakeOpenAI, status: int) -> None:
    fake.enqueue(error(status, "nope"))
    with pytest.raises(ModelError, match=f"HTTP {status}"):
        make("openai-responses:o4-mini").complete(request())
    assert len(fake.requests) == 1


def test_429_for_exhausted_quota_is_not_retried(fake: FakeOpenAI) -> None:
    fake.enqueue(error(429, "You exceeded your current quota", code="insufficient_quota"))
    with pytest.raises(ModelError, match="insufficient_quota"):
        make("openai:gpt-4.1").complete(request())
    assert len(fake.requests) == 1


def test_evidence_body_is_truncated_to_4_kib(fake: FakeOpenAI) -> None:
    fake.enqueue(error(400, "é" * 10_000))
    with pytest.raises(ModelError) as caught:
        make("openai:gpt-4.1").complete(request())
    assert 4000 < len(caught.value.evidence["body"].encode()) <= 4096


# -- secrets ---------------------------------------------------------------------------------


def test_the_api_key_never_leaks(
    fake: FakeOpenAI, env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    env.setenv("CHARLIE_MODEL_MAX_ATTEMPTS", "2")
    env.setenv("CHARLIE_MODEL_TIMEOUT", "0.2")
    failures: list[Exception] = []

    fake.enqueue(echoing_auth(401))
    with pytest.raises(ModelError) as refused:
        make("openai:gpt-4.1").complete(request())
    failures.append(refused.value)

    fake.enqueue(echoing_auth(500), echoing_auth(503))
    with pytest.raises(TransientModelError) as exhausted:
        make("openai-responses:o4-mini").complete(request())
    failures.append(exhausted.value)

    fake.enqueue(slow(chat_text("x"), 0.5), echoing_auth(429))
    with pytest.raises(TransientModelError) as timed_out:
        make("openai:gpt-4.1").complete(request())
    failures.append(timed_out.value)

    # the key was really sent, and really echoed back
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in fake.requests)
    assert "Bearer [REDACTED]" in refused.value.evidence["body"]
    for failure in failures:
        evidence = json.dumps(getattr(failure, "evidence", None))
        assert KEY not in str(failure) and KEY not in repr(failure)
        assert KEY not in evidence
        assert "authorization" not in evidence.lower()
        assert failure.__cause__ is None
    assert caplog.records, "the failures were logged"
    assert KEY not in caplog.text
    for record in caplog.records:
        assert KEY not in repr(record.__dict__)
    retries = [r for r in caplog.records if r.name == "charlie.models.openai"]
    assert {"task_id", "turn", "attempt", "status"} <= set(retries[0].__dict__)
    assert retries[0].__dict__["task_id"] == "task-1"


def test_the_sdks_own_environment_sends_no_credential(
    fake: FakeOpenAI, env: pytest.MonkeyPatch
) -> None:
    # The openai SDK reads OPENAI_* itself. Charlie gives it the key and URL it configured, so
    # an ambient key, organization, project or base URL never goes to a model's host, with a key
    # configured or without one, streamed or not.
    env.setenv("OPENAI_API_KEY", "sk-ambient")
    env.setenv("OPENAI_ADMIN_KEY", "sk-admin")
    env.setenv("OPENAI_ORG_ID", "org-ambient")
    env.setenv("OPENAI_PROJECT_ID", "proj-ambient")
    env.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    env.setenv("OPENAI_CUSTOM_HEADERS", "Authorization: Bearer sk-custom")
    env.delenv("CHARLIE_MODEL_API_KEY")
    fake.enqueue(chat_text("hi"), response([message_item("m", "hi")]), chat_text("hi"))
    make("openai:local-llama").complete(request())
    make("openai-responses:local-llama").complete(request())
    streamed = ModelRequest("task-1", "exec-1", 0, context(), [], deltas=Recorder())
    make("openai:local-llama").complete(streamed)
    env.setenv("CHARLIE_MODEL_API_KEY", KEY)
    fake.enqueue(chat_text("hi"))
    make("openai:gpt-4.1").complete(request())
    sent = [r.headers for r in fake.requests]
    assert len(sent) == 4
    assert ["authorization" in h for h in sent] == [False, False, False, True]
    assert sent[3]["authorization"] == f"Bearer {KEY}"
    for headers in sent:
        assert not {"openai-organization", "openai-project"} & set(headers)
        assert headers["user-agent"] == "charlie/0.1"


class Recorder:
    """Deltas that keep nothing: asks for a stream."""

    def text(self, delta: str) -> None:
        pass

    def reasoning(self, delta: str) -> None:
        pass

    def tool_call(self, call_id: str, name: str | None, arguments_delta: str) -> None:
        pass

    def restart(self, reason: str) -> None:
        pass
