"""Pure mapping and configuration of the OpenAI clients, without HTTP."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from charlie.domain import Item, ItemKind, NewItem
from charlie.models.base import ModelError, tool_call_item
from charlie.models.openai import EndpointConfig, env_name, parse_retry_after
from charlie.models.openai_chat import MalformedResponse, chat_messages, parse_chat_completion
from charlie.models.openai_responses import parse_response, replayable, responses_input

KEY = "sk-unit-secret-123456"


def item(seq: int, turn: int, new: NewItem) -> Item:
    return Item(seq, turn, new.kind, new.call_id, new.payload)


def message(text: str) -> NewItem:
    return NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text})


def final(text: str) -> NewItem:
    return NewItem(ItemKind.FINAL, {"content": text})


def result(call_id: str, content: str) -> NewItem:
    return NewItem(
        ItemKind.TOOL_RESULT,
        {"name": "t", "outcome": "ok", "result": content, "content": content},
        call_id=call_id,
    )


def user(text: str) -> NewItem:
    return NewItem(ItemKind.INPUT, {"role": "user", "content": text})


# -- configuration ---------------------------------------------------------------------------


def test_env_name() -> None:
    assert env_name("gpt-4.1-mini") == "GPT_4_1_MINI"
    assert env_name("meta/llama3:8b") == "META_LLAMA3_8B"


def test_config_defaults() -> None:
    config = EndpointConfig.from_env("gpt-4.1", {})
    assert config.base_url == "https://api.openai.com/v1"
    assert config.api_key is None
    assert (config.read_timeout, config.connect_timeout, config.max_attempts) == (120, 10, 5)


def test_config_overrides() -> None:
    env = {
        "CHARLIE_MODEL_BASE_URL": "http://global/v1/",
        "CHARLIE_MODEL_API_KEY": "sk-global",
        "CHARLIE_MODEL_O4_MINI_API_KEY": KEY,
        "CHARLIE_MODEL_TIMEOUT": "30",
        "CHARLIE_MODEL_MAX_ATTEMPTS": "2",
    }
    config = EndpointConfig.from_env("o4-mini", env)
    assert config.base_url == "http://global/v1"
    assert config.api_key == KEY
    assert config.read_timeout == 30 and config.max_attempts == 2
    assert KEY not in repr(config)
    assert EndpointConfig.from_env("gpt-4.1", env).api_key == "sk-global"


@pytest.mark.parametrize(
    "env",
    [
        {"CHARLIE_MODEL_TIMEOUT": "soon"},
        {"CHARLIE_MODEL_TIMEOUT": "0"},
        {"CHARLIE_MODEL_MAX_ATTEMPTS": "2.5"},
        {"CHARLIE_MODEL_MAX_ATTEMPTS": "-1"},
        {"CHARLIE_MODEL_BASE_URL": "api.openai.com/v1"},
        {"CHARLIE_MODEL_API_KEY": "sk-two words"},
    ],
)
def test_bad_config_is_a_model_error(env: dict[str, str]) -> None:
    with pytest.raises(ModelError) as caught:
        EndpointConfig.from_env("gpt-4.1", env)
    assert "sk-two" not in str(caught.value)


def test_parse_retry_after() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after({"retry-after": "7"}) == 7
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"retry-after": "-3"}) == 0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"retry-after": "Wed, 01 Jan 2025 12:01:30 GMT"}, now) == 90
    assert parse_retry_after({"retry-after": "Wed, 01 Jan 2025 11:00:00 GMT"}, now) == 0
    assert parse_retry_after({"retry-after": "whenever"}) is None
    assert parse_retry_after({}) is None


# -- Chat requests ---------------------------------------------------------------------------


def test_chat_final_that_repeats_the_last_message_is_sent_once() -> None:
    items = [item(1, 0, user("hi")), item(2, 0, message("Done.")), item(3, 0, final("Done."))]
    assert chat_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Done."},
    ]


def test_chat_final_on_its_own_is_an_assistant_message() -> None:
    items = [item(1, 0, user("hi")), item(2, 0, final("Answer.")), item(3, 1, user("more?"))]
    assert chat_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Answer."},
        {"role": "user", "content": "more?"},
    ]


def test_chat_groups_by_turn_and_keeps_every_message() -> None:
    items = [
        item(1, 0, message("one")),
        item(2, 0, message("two")),  # a second message starts a second assistant message
        item(3, 0, tool_call_item("a", "t", "{}")),
        item(4, 0, result("a", "A")),
        item(5, 1, message("three")),  # a new turn never joins the previous one
        item(6, 2, tool_call_item("b", "t", "[1]")),
        item(7, 2, result("b", "B")),
    ]
    call_a = {"id": "a", "type": "function", "function": {"name": "t", "arguments": "{}"}}
    call_b = {"id": "b", "type": "function", "function": {"name": "t", "arguments": "[1]"}}
    assert chat_messages(items) == [
        {"role": "assistant", "content": "one"},
        {"role": "assistant", "content": "two", "tool_calls": [call_a]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "assistant", "content": "three"},
        {"role": "assistant", "content": None, "tool_calls": [call_b]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
    ]


def test_chat_results_follow_call_order_and_items_follow_seq() -> None:
    calls = [tool_call_item(c, "t", "{}") for c in ("x", "y", "z")]
    items = [
        item(5, 0, result("z", "Z")),
        item(1, 0, calls[0]),
        item(4, 0, result("y", "Y")),
        item(2, 0, calls[1]),
        item(6, 0, result("x", "X")),
        item(3, 0, calls[2]),
    ]
    tools = [m for m in chat_messages(items) if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["x", "y", "z"]


# -- Responses requests ----------------------------------------------------------------------


def test_responses_input_without_raw_items() -> None:
    items = [
        item(1, 0, user("hi")),
        item(2, 0, NewItem(ItemKind.REASONING, {"summary": "from a chat model", "raw": None})),
        item(3, 0, message("Hello.")),
        item(4, 0, final("Hello.")),
        item(5, 1, final("Bye.")),
    ]
    assert responses_input(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "Bye."},
    ]


def test_responses_output_round_trips_into_input() -> None:
    raw: list[dict[str, Any]] = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "phase": "commentary",
            "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "t",
            "arguments": '{"a" :1}',
            "status": "completed",
        },
    ]
    parsed = parse_response({"status": "completed", "output": raw})
    items = [item(n + 1, 0, new) for n, new in enumerate(parsed.output)]
    assert responses_input(items) == [
        replayable(raw[0]),
        replayable(raw[1]),
        {"type": "function_call", "call_id": "call_1", "name": "t", "arguments": '{"a" :1}'},
    ]
    assert "id" not in replayable(raw[0]) and raw[0]["id"] == "rs_1"


# -- parsing ---------------------------------------------------------------------------------


def chat(message: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [{"message": message, "finish_reason": "stop"}]}


def test_chat_parse_never_drops_or_merges_calls() -> None:
    calls = [
        {"id": "dup", "function": {"name": "a", "arguments": "{}"}},
        {"id": "dup", "function": {"name": "b", "arguments": {"k": 1}}},
        {"function": {"name": "c"}},
        {"id": "", "function": {"name": "d", "arguments": "{"}},
    ]
    out = parse_chat_completion(chat({"content": None, "tool_calls": calls})).output
    assert [(i.call_id, i.payload["name"]) for i in out] == [
        ("dup", "a"),
        ("dup_1", "b"),
        ("call_2", "c"),
        ("call_3", "d"),
    ]
    assert out[1].payload["arguments"] == {"k": 1}
    assert out[2].payload == {"name": "c", "arguments": {}, "raw_arguments": ""}
    assert out[3].payload["arguments"] is None
    # usage absent: zeros
    assert parse_chat_completion(chat({"content": "x"})).usage.as_dict() == {
        "input_tokens": 0,
        "output_tokens": 0,
        "reasoning_tokens": 0,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
    }


def test_chat_parse_refusal_and_reasoning_content() -> None:
    out = parse_chat_completion(
        chat({"content": None, "refusal": "I can't.", "reasoning_content": "policy"})
    ).output
    assert [i.kind for i in out] == [ItemKind.REASONING, ItemKind.MESSAGE]
    assert out[1].payload["content"] == "I can't."


@pytest.mark.parametrize(
    "body",
    [[], {"choices": []}, {"choices": [{}]}, chat({"content": ""}), chat({"tool_calls": ["x"]})],
)
def test_chat_parse_rejects_malformed(body: Any) -> None:
    with pytest.raises(MalformedResponse):
        parse_chat_completion(body)


def test_responses_parse_skips_unknown_items_and_rejects_failures() -> None:
    parsed = parse_response(
        {
            "output": [
                {"type": "web_search_call", "id": "ws_1"},
                {"type": "message", "content": [{"type": "refusal", "refusal": "No."}]},
            ]
        }
    )
    assert [i.payload["content"] for i in parsed.output] == ["No."]
    with pytest.raises(MalformedResponse, match="failed"):
        parse_response({"status": "failed", "error": {"code": "server_error"}, "output": []})
    with pytest.raises(MalformedResponse):
        parse_response({"output": []})


def test_the_providers_finish_reason_is_kept_for_telemetry() -> None:
    body = {"choices": [{"message": {"content": "cut"}, "finish_reason": "length"}]}
    assert parse_chat_completion(body).finish_reason == "length"
    assert parse_chat_completion(chat({"content": "x"})).finish_reason == "stop"
    done = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]}
    assert parse_response(done).finish_reason == "stop"
    cut = {**done, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    assert parse_response(cut).finish_reason == "length"
