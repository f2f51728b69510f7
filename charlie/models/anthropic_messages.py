"""Anthropic Messages API mapping: transcript items to ``system``/``messages``/``tools`` and a
message's content blocks to output items.

Pure functions, no I/O; :mod:`charlie.models.anthropic` does the HTTP (through the SDK).

Requests: ``system`` inputs become the ``system`` text blocks; a user input a ``user`` text
block; the ``reasoning``, ``message`` and ``tool_call`` items of a turn one ``assistant`` message
of the blocks the model sent, in its order: ``thinking`` and ``redacted_thinking`` blocks from the
``raw`` the reasoning item keeps, replayed unchanged, signature included (the API refuses a tool
loop whose thinking blocks were dropped or edited), text from ``raw`` when kept, and ``tool_use``
blocks with the call's id, name and arguments. A run of ``tool_result`` items becomes ONE user
message of ``tool_result`` blocks answering every call of the turn, in call order, first in that
message (the API refuses text before them); a failed outcome is sent with ``is_error: true``.
Consecutive blocks of one role share one message (the API wants the roles to alternate).

Prompt caching: ``cache_control: {"type": "ephemeral"}`` breakpoints, at most four (the API's
limit), on the last tool, the last system block, the last block of the newest user message (the
prefix the next call reads back) and the last block of the user message before it (the prefix the
previous call wrote), so a long run pays for its prefix once.

Responses: every content block in order: ``thinking``/``redacted_thinking`` become ``reasoning``
items (``summary`` the thinking text, ``raw`` the block), ``text`` a ``message`` item (``raw`` the
block), ``tool_use`` a ``tool_call`` item with the raw argument string the model streamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from charlie.domain import JSON, Item, ItemKind, NewItem
from charlie.models.base import ModelRequest, ModelResponse, ToolSpec, Usage, tool_call_item
from charlie.models.openai_chat import (
    MalformedResponse,
    is_repeated_final,
    ordered_results,
    token_count,
    unique_call_id,
)

EPHEMERAL: JSON = {"type": "ephemeral"}
MAX_BREAKPOINTS = 4
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def anthropic_tools(tools: Sequence[ToolSpec]) -> list[JSON]:
    return [
        {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}
        for tool in tools
    ]


def request_params(
    model: str,
    request: ModelRequest,
    *,
    max_tokens: int,
    thinking: JSON | None = None,
    cache: bool = True,
) -> JSON:
    """The keyword arguments of ``messages.stream`` (the body without ``stream``)."""
    system, messages = anthropic_messages(request.items)
    params: JSON = {"model": model, "max_tokens": max_tokens, "messages": messages}
    if system:
        params["system"] = system
    if request.tools:
        params["tools"] = anthropic_tools(request.tools)
    if thinking is not None:
        params["thinking"] = dict(thinking)
    if cache:
        add_cache_breakpoints(params)
    return params


def add_cache_breakpoints(params: JSON) -> None:
    """Mark the stable prefixes (see the module); at most :data:`MAX_BREAKPOINTS`."""
    marked = 0
    tools = params.get("tools")
    if tools:
        tools[-1]["cache_control"] = dict(EPHEMERAL)
        marked += 1
    system = params.get("system")
    if system:
        system[-1]["cache_control"] = dict(EPHEMERAL)
        marked += 1
    users = [m for m in params["messages"] if m["role"] == "user" and m["content"]]
    for message in list(reversed(users[-2:]))[: MAX_BREAKPOINTS - marked]:
        message["content"][-1]["cache_control"] = dict(EPHEMERAL)


def _clean(block: Mapping[str, Any]) -> JSON:
    """A block as it goes back: the provider's fields as they came, without empty ones."""
    return {key: value for key, value in block.items() if value is not None}


def anthropic_messages(items: Iterable[Item]) -> tuple[list[JSON], list[JSON]]:
    """``(system blocks, messages)`` for the transcript."""
    system: list[JSON] = []
    messages: list[JSON] = []
    call_order: dict[str, int] = {}
    results: list[Item] = []
    previous: Item | None = None

    def add(role: str, block: JSON) -> None:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": role, "content": [block]})

    def flush_results() -> None:
        if not results:
            return
        blocks: list[JSON] = []
        for result in ordered_results(results, call_order):
            block: JSON = {"type": "tool_result", "tool_use_id": result.call_id}
            content = result.payload.get("content")
            if isinstance(content, str) and content:
                block["content"] = content
            if result.payload.get("outcome", "ok") != "ok":
                block["is_error"] = True
            blocks.append(block)
        results.clear()
        if messages and messages[-1]["role"] == "user":
            # the tool results come first in their user message (a person's note that arrived
            # meanwhile stays after them)
            messages[-1]["content"][:0] = blocks
        else:
            messages.append({"role": "user", "content": blocks})

    for item in sorted(items, key=lambda i: i.seq):
        kind = item.kind
        payload = item.payload
        if kind is ItemKind.TOOL_RESULT:
            results.append(item)
            previous = item
            continue
        flush_results()
        if kind is ItemKind.INPUT:
            content = payload.get("content") or ""
            if payload.get("role") == "system":
                if content:
                    system.append({"type": "text", "text": content})
            elif content:
                add("user", {"type": "text", "text": content})
        elif kind is ItemKind.REASONING:
            raw = payload.get("raw")
            # another provider's reasoning cannot be replayed here: it is left out
            if isinstance(raw, dict) and raw.get("type") in THINKING_BLOCKS:
                add("assistant", _clean(raw))
        elif kind is ItemKind.MESSAGE:
            raw = payload.get("raw")
            if isinstance(raw, dict) and raw.get("type") == "text" and raw.get("text"):
                add("assistant", _clean(raw))
            elif payload.get("content"):
                add("assistant", {"type": "text", "text": payload["content"]})
        elif kind is ItemKind.TOOL_CALL:
            call_order[item.call_id or ""] = len(call_order)
            arguments = payload.get("arguments")
            add(
                "assistant",
                {
                    "type": "tool_use",
                    "id": item.call_id,
                    "name": payload["name"],
                    # arguments that were not a JSON object go back as {} (the call failed)
                    "input": arguments if isinstance(arguments, dict) else {},
                },
            )
        elif (
            kind is ItemKind.FINAL
            and not is_repeated_final(item, previous)
            and payload.get("content")
        ):
            add("assistant", {"type": "text", "text": payload["content"]})
        previous = item
    flush_results()
    return system, messages


def _reasoning_text(block: Mapping[str, Any]) -> str | None:
    text = block.get("thinking")
    return text if isinstance(text, str) and text else None


def parse_content(
    content: Any,
    raw_inputs: Mapping[int, str] | None = None,
) -> list[NewItem]:
    """Output items from a message's content blocks. ``raw_inputs`` are the argument strings
    streamed for the ``tool_use`` blocks, by block index (the block's ``input`` otherwise)."""
    if not isinstance(content, list):
        raise MalformedResponse("the message has no content list")
    raw_inputs = raw_inputs or {}
    output: list[NewItem] = []
    seen: set[str] = set()
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            raise MalformedResponse(f"content block {index} is not an object")
        kind = block.get("type")
        if kind in THINKING_BLOCKS:
            output.append(
                NewItem(ItemKind.REASONING, {"summary": _reasoning_text(block), "raw": dict(block)})
            )
        elif kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                output.append(
                    NewItem(
                        ItemKind.MESSAGE,
                        {"role": "assistant", "content": text, "raw": dict(block)},
                    )
                )
        elif kind == "tool_use":
            name = block.get("name")
            raw: str | dict[str, Any]
            if index in raw_inputs:
                raw = raw_inputs[index]
            else:
                value = block.get("input")
                raw = value if isinstance(value, dict) else json.dumps(value)
            output.append(
                tool_call_item(
                    unique_call_id(block.get("id"), index, seen),
                    name if isinstance(name, str) else "",
                    raw,
                )
            )
    return output


def parse_message(
    data: Any,
    raw_inputs: Mapping[int, str] | None = None,
    usage: Usage | None = None,
) -> ModelResponse:
    """A complete message as a response; ``usage`` overrides the message's own (the sum over a
    turn continued after ``pause_turn``)."""
    if not isinstance(data, dict):
        raise MalformedResponse("the message is not a JSON object")
    output = parse_content(data.get("content"), raw_inputs)
    if not any(item.kind in (ItemKind.MESSAGE, ItemKind.TOOL_CALL) for item in output):
        raise MalformedResponse(
            f"the model returned neither text nor tool calls (stop_reason="
            f"{data.get('stop_reason')!r})"
        )
    stop = data.get("stop_reason")
    return ModelResponse(
        output=output,
        finish_reason=stop if isinstance(stop, str) else None,
        usage=usage if usage is not None else usage_of(data.get("usage")),
    )


def usage_of(usage: Any) -> Usage:
    """Charlie's usage from a message's: ``input_tokens`` counts every input token (the API's
    uncached ones, plus those read from and written to the cache, which are also counted on
    their own and priced at their rates); reasoning tokens are part of the output tokens."""
    uncached = token_count(usage, "input_tokens")
    read = token_count(usage, "cache_read_input_tokens")
    written = token_count(usage, "cache_creation_input_tokens")
    return Usage(
        input_tokens=uncached + read + written,
        output_tokens=token_count(usage, "output_tokens"),
        reasoning_tokens=token_count(usage, "output_tokens_details", "thinking_tokens"),
        cache_read_tokens=read,
        cache_write_tokens=written,
    )


def add_usage(a: Usage, b: Usage) -> Usage:
    return Usage(
        input_tokens=a.input_tokens + b.input_tokens,
        output_tokens=a.output_tokens + b.output_tokens,
        reasoning_tokens=a.reasoning_tokens + b.reasoning_tokens,
        cache_read_tokens=a.cache_read_tokens + b.cache_read_tokens,
        cache_write_tokens=a.cache_write_tokens + b.cache_write_tokens,
    )


def message_text(data: Mapping[str, Any]) -> str:
    """The text blocks of a message, joined (what a refusal said)."""
    content = data.get("content")
    if not isinstance(content, list):
        return ""
    texts = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(t for t in texts if isinstance(t, str))


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)
