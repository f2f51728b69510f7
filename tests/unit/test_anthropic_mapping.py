"""The Anthropic Messages mapping (pure), the client's configuration, and cache pricing."""

from __future__ import annotations

import json

import pytest

from charlie import pricing, views
from charlie.domain import Item, ItemKind
from charlie.models.anthropic import AnthropicConfig
from charlie.models.anthropic_messages import (
    anthropic_messages,
    parse_content,
    parse_message,
    request_params,
    usage_of,
)
from charlie.models.base import ModelError, ModelRequest, ToolSpec
from charlie.models.openai_chat import MalformedResponse

SYSTEM = Item(1, 0, ItemKind.INPUT, None, {"role": "system", "content": "Be brief."})
USER = Item(2, 0, ItemKind.INPUT, None, {"role": "user", "content": "Go."})
TOOL = ToolSpec("grep", "Search.", {"type": "object", "properties": {}})
SIGNED = {"type": "thinking", "thinking": "plan", "signature": "sig-1"}


def call(seq: int, call_id: str, arguments: object = None, turn: int = 0) -> Item:
    return Item(
        seq,
        turn,
        ItemKind.TOOL_CALL,
        call_id,
        {"name": "grep", "arguments": arguments, "raw_arguments": json.dumps(arguments)},
    )


def result(seq: int, call_id: str, outcome: str = "ok", turn: int = 0) -> Item:
    return Item(
        seq,
        turn,
        ItemKind.TOOL_RESULT,
        call_id,
        {"name": "grep", "outcome": outcome, "result": "r", "content": f"out {call_id}"},
    )


def test_a_turn_is_one_assistant_message_and_its_results_one_user_message() -> None:
    items = [
        SYSTEM,
        USER,
        Item(3, 0, ItemKind.REASONING, None, {"summary": "plan", "raw": SIGNED}),
        Item(4, 0, ItemKind.MESSAGE, None, {"role": "assistant", "content": "Looking."}),
        call(5, "t1", {"pattern": "a"}),
        call(6, "t2", None),  # arguments that were not JSON go back as {}
        result(8, "t2", outcome="error"),  # committed out of call order
        result(7, "t1"),
        Item(9, 1, ItemKind.INPUT, None, {"role": "user", "content": "note from a person"}),
    ]
    system, messages = anthropic_messages(items)
    assert system == [{"type": "text", "text": "Be brief."}]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == [
        SIGNED,
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "a"}},
        {"type": "tool_use", "id": "t2", "name": "grep", "input": {}},
    ]
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "t1", "content": "out t1"},
        {"type": "tool_result", "tool_use_id": "t2", "content": "out t2", "is_error": True},
        {"type": "text", "text": "note from a person"},
    ]


def test_results_come_first_even_after_a_note_that_arrived_before_them() -> None:
    items = [
        USER,
        call(3, "t1", {}),
        Item(4, 0, ItemKind.INPUT, None, {"role": "user", "content": "hurry"}),
        result(5, "t1"),
    ]
    _, messages = anthropic_messages(items)
    assert [b["type"] for b in messages[-1]["content"]] == ["tool_result", "text"]


def test_other_providers_reasoning_and_a_repeated_final_are_left_out() -> None:
    items = [
        USER,
        Item(3, 0, ItemKind.REASONING, None, {"summary": "x", "raw": {"type": "reasoning"}}),
        Item(4, 0, ItemKind.MESSAGE, None, {"role": "assistant", "content": "Done."}),
        Item(5, 0, ItemKind.FINAL, None, {"content": "Done."}),
    ]
    _, messages = anthropic_messages(items)
    assert messages[1] == {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}


def test_at_most_four_cache_breakpoints_on_the_stable_prefixes() -> None:
    items = [SYSTEM, USER, call(3, "t1", {}), result(4, "t1"), call(5, "t2", {}, turn=1)]
    items.append(result(6, "t2", turn=1))
    request = ModelRequest("t", "e", 2, items, [TOOL, TOOL])
    params = request_params("m", request, max_tokens=100)
    assert json.dumps(params).count("cache_control") == 4
    assert "cache_control" in params["tools"][-1] and "cache_control" not in params["tools"][0]
    assert "cache_control" in params["system"][-1]
    users = [m for m in params["messages"] if m["role"] == "user"]
    assert "cache_control" not in users[0]["content"][-1]
    assert all("cache_control" in m["content"][-1] for m in users[1:])
    # the items themselves were not changed (they are shared with the transcript cache)
    assert "cache_control" not in json.dumps([i.payload for i in items])
    plain = request_params("m", request, max_tokens=100, cache=False)
    assert "cache_control" not in json.dumps(plain)


def test_content_blocks_become_items_in_order() -> None:
    blocks = [
        SIGNED,
        {"type": "redacted_thinking", "data": "xx"},
        {"type": "text", "text": "Hi."},
        {"type": "tool_use", "id": "t1", "name": "grep", "input": {"pattern": "a"}},
        {"type": "tool_use", "id": "t1", "name": "grep", "input": {}},
    ]
    items = parse_content(blocks, {4: '{"pattern": '})
    assert [i.kind for i in items] == [
        ItemKind.REASONING,
        ItemKind.REASONING,
        ItemKind.MESSAGE,
        ItemKind.TOOL_CALL,
        ItemKind.TOOL_CALL,
    ]
    assert items[0].payload == {"summary": "plan", "raw": SIGNED}
    assert items[1].payload["summary"] is None
    assert items[3].payload["arguments"] == {"pattern": "a"}
    assert items[4].call_id != "t1"  # a duplicate id is made unique
    assert items[4].payload["arguments"] is None  # the streamed string was not JSON
    with pytest.raises(MalformedResponse, match="neither text nor tool calls"):
        parse_message({"content": [SIGNED], "stop_reason": "end_turn"})


def test_usage_counts_cache_tokens_as_part_of_the_input() -> None:
    usage = usage_of(
        {
            "input_tokens": 10,
            "output_tokens": 7,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 50,
            "output_tokens_details": {"thinking_tokens": 3},
        }
    )
    assert usage.as_dict() == {
        "input_tokens": 160,
        "output_tokens": 7,
        "reasoning_tokens": 3,
        "cache_read_tokens": 100,
        "cache_write_tokens": 50,
    }


def test_config_from_the_environment() -> None:
    config = AnthropicConfig.from_env("claude-x", {"ANTHROPIC_API_KEY": "sk-secret"})
    assert config.base_url == "https://api.anthropic.com"
    assert config.api_key == "sk-secret" and config.max_tokens == 8192 and not config.thinking
    assert "sk-secret" not in repr(config)
    env = {
        "ANTHROPIC_API_KEY": "shared",
        "ANTHROPIC_BASE_URL": "https://proxy.example/",
        "CHARLIE_MODEL_CLAUDE_X_THINKING_BUDGET": "4000",
        "CHARLIE_MODEL_CLAUDE_X_PROMPT_CACHE": "0",
    }
    config = AnthropicConfig.from_env("claude-x", env)
    assert config.base_url == "https://proxy.example" and config.api_key == "shared"
    assert config.thinking == {"type": "enabled", "budget_tokens": 4000}
    assert config.max_tokens == 8192 + 4000 and not config.prompt_cache
    # the shared key stays with its host: a model sent elsewhere needs its own
    elsewhere = {**env, "CHARLIE_MODEL_CLAUDE_X_BASE_URL": "https://other.example"}
    assert AnthropicConfig.from_env("claude-x", elsewhere).api_key is None
    own = {**elsewhere, "CHARLIE_MODEL_CLAUDE_X_API_KEY": "own"}
    assert AnthropicConfig.from_env("claude-x", own).api_key == "own"
    adaptive = {"CHARLIE_MODEL_CLAUDE_X_THINKING_BUDGET": "adaptive"}
    assert AnthropicConfig.from_env("claude-x", adaptive).thinking == {"type": "adaptive"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CHARLIE_MODEL_C_THINKING_BUDGET": "500"}, "below the API's minimum"),
        (
            {"CHARLIE_MODEL_C_THINKING_BUDGET": "2000", "CHARLIE_MODEL_C_MAX_TOKENS": "2000"},
            "must be above the thinking budget",
        ),
        ({"CHARLIE_MODEL_C_MAX_TOKENS": "many"}, "not a positive number"),
        ({"ANTHROPIC_BASE_URL": "ftp://x"}, "not an http"),
    ],
)
def test_bad_config_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        AnthropicConfig.from_env("c", env)


def test_cache_tokens_are_priced_at_their_rates() -> None:
    table = pricing.parse_prices(
        json.dumps(
            {"anthropic:": {"input": 3, "output": 15, "cache_read": 0.3, "cache_write": 3.75}}
        )
    )
    cost = pricing.cost_usd(
        "anthropic:c", 1000, 10, 0, table, cache_read_tokens=600, cache_write_tokens=300
    )
    assert cost == pytest.approx((100 * 3 + 600 * 0.3 + 300 * 3.75 + 10 * 15) / 1e6)
    # without cache rates, cache tokens cost what input tokens do
    plain = pricing.parse_prices('{"anthropic:": {"input": 3, "output": 15}}')
    assert pricing.cost_usd(
        "anthropic:c", 1000, 0, 0, plain, cache_read_tokens=600
    ) == pytest.approx(1000 * 3 / 1e6)
    spent = pricing.spent(
        [("anthropic:c", {"input_tokens": 1000, "cache_read_tokens": 600, "model_calls": 1})],
        table,
    )
    assert spent["cache_read_tokens"] == 600
    assert spent["usd"] == pytest.approx((400 * 3 + 600 * 0.3) / 1e6)
    with pytest.raises(pricing.PriceError, match="cache_read and cache_write"):
        pricing.parse_prices('{"a:": {"input": 1, "output": 1, "cache": 1}}')


def test_the_tokens_line_shows_cache_tokens_when_there_are_any() -> None:
    usage = {"input_tokens": 5, "output_tokens": 2, "reasoning_tokens": 0}
    assert views.tokens_text(usage) == "in 5, out 2, reasoning 0"
    usage.update(cache_read_tokens=3, cache_write_tokens=1)
    assert views.tokens_text(usage, " · ") == (
        "in 5 · out 2 · reasoning 0 · cache read 3 · cache write 1"
    )
