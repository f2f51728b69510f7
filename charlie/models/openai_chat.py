"""Chat Completions mapping: transcript items to ``messages`` and a completion to output items.

Pure functions, no I/O; :mod:`charlie.models.openai` does the HTTP.

Requests: ``input`` items become system/user messages; the ``message`` and ``tool_call`` items of
one turn that follow each other become one assistant message with ``tool_calls`` (each carrying
the raw argument string the model sent); ``reasoning`` has no place in this API and is skipped;
a run of ``tool_result`` items becomes ``tool`` messages in the order of the calls they answer;
``final`` becomes an assistant message (unless it repeats the message right before it).

Responses: the first choice's content (or refusal) becomes a ``message`` item, then every tool
call, in the order sent, a ``tool_call`` item; a call without an id gets ``call_<index>``.
Reasoning text some compatible servers add (``reasoning_content``) becomes a ``reasoning`` item
first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from charlie.domain import JSON, Item, ItemKind, NewItem
from charlie.models.base import ModelRequest, ModelResponse, ToolSpec, Usage, tool_call_item


class MalformedResponse(ValueError):
    """The provider answered 200 with something that is not a usable model turn."""


def chat_tools(tools: Sequence[ToolSpec]) -> list[JSON]:
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
        for tool in tools
    ]


def chat_request_body(model: str, request: ModelRequest) -> JSON:
    body: JSON = {"model": model, "messages": chat_messages(request.items)}
    if request.tools:
        body["tools"] = chat_tools(request.tools)
        body["parallel_tool_calls"] = True
    return body


def ordered_results(results: list[Item], call_order: dict[str, int]) -> list[Item]:
    """A run of tool results in the order of the calls they answer; unknown ids keep their place
    after the known ones."""
    last = len(call_order) + len(results)
    ranked = sorted(
        enumerate(results),
        key=lambda pair: (call_order.get(pair[1].call_id or "", last), pair[0]),
    )
    return [item for _, item in ranked]


def is_repeated_final(item: Item, previous: Item | None) -> bool:
    """A ``final`` item that only restates the assistant message just before it."""
    return (
        previous is not None
        and previous.kind is ItemKind.MESSAGE
        and previous.turn == item.turn
        and previous.payload.get("content") == item.payload.get("content")
    )


def chat_messages(items: Iterable[Item]) -> list[JSON]:
    messages: list[JSON] = []
    assistant: JSON | None = None  # the assistant message the current turn is still adding to
    assistant_turn = -1
    call_order: dict[str, int] = {}
    results: list[Item] = []
    previous: Item | None = None

    def flush_results() -> None:
        for result in ordered_results(results, call_order):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": result.call_id,
                    "content": result.payload["content"],
                }
            )
        results.clear()

    for item in sorted(items, key=lambda i: i.seq):
        kind = item.kind
        if kind is ItemKind.TOOL_RESULT:
            assistant = None
            results.append(item)
            previous = item
            continue
        flush_results()
        if kind is ItemKind.REASONING:
            previous = item
            continue
        if kind in (ItemKind.MESSAGE, ItemKind.TOOL_CALL):
            starts_new = (
                assistant is None
                or assistant_turn != item.turn
                or (
                    kind is ItemKind.MESSAGE
                    and (assistant["content"] is not None or "tool_calls" in assistant)
                )
            )
            if assistant is None or starts_new:
                assistant = {"role": "assistant", "content": None}
                assistant_turn = item.turn
                messages.append(assistant)
            if kind is ItemKind.MESSAGE:
                assistant["content"] = item.payload["content"]
            else:
                calls: list[JSON] = assistant.setdefault("tool_calls", [])
                call_order[item.call_id or ""] = len(call_order)
                calls.append(
                    {
                        "id": item.call_id,
                        "type": "function",
                        "function": {
                            "name": item.payload["name"],
                            "arguments": item.payload["raw_arguments"],
                        },
                    }
                )
            previous = item
            continue
        assistant = None
        if kind is ItemKind.INPUT:
            messages.append({"role": item.payload["role"], "content": item.payload["content"]})
        elif kind is ItemKind.FINAL and not is_repeated_final(item, previous):
            messages.append({"role": "assistant", "content": item.payload["content"]})
        previous = item
    flush_results()
    return messages


def unique_call_id(candidate: Any, index: int, seen: set[str]) -> str:
    """The provider's id, or ``call_<index>`` when it sent none; never one already used in this
    response (a duplicate gets ``_<index>`` appended)."""
    call_id = candidate if isinstance(candidate, str) and candidate else f"call_{index}"
    while call_id in seen:
        call_id = f"{call_id}_{index}"
    seen.add(call_id)
    return call_id


def raw_arguments(value: Any) -> str | dict[str, Any]:
    """The argument string as sent; a server that sends an object gets it kept as one."""
    if isinstance(value, str | dict):
        return value
    if value is None:
        return ""
    return json.dumps(value)


def token_count(block: Any, *path: str) -> int:
    for key in path:
        if not isinstance(block, dict):
            return 0
        block = block.get(key)
    return block if isinstance(block, int) and not isinstance(block, bool) else 0


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # some compatible servers send content parts
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return None


def parse_chat_completion(data: Any) -> ModelResponse:
    if not isinstance(data, dict):
        raise MalformedResponse("the response is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedResponse("the response has no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise MalformedResponse("the first choice has no message")
    text = _text(message.get("content")) or _text(message.get("refusal"))
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise MalformedResponse("tool_calls is not a list")
    if not text and not tool_calls:
        raise MalformedResponse(
            "the model returned neither content nor tool calls "
            f"(finish_reason={choice.get('finish_reason')!r})"
        )
    output: list[NewItem] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(NewItem(ItemKind.REASONING, {"summary": reasoning, "raw": None}))
    if text:
        output.append(NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text}))
    seen: set[str] = set()
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise MalformedResponse(f"tool call {index} is not an object")
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        name = function.get("name")
        output.append(
            tool_call_item(
                unique_call_id(call.get("id"), index, seen),
                name if isinstance(name, str) else "",
                raw_arguments(function.get("arguments")),
            )
        )
    usage = data.get("usage")
    finish = choice.get("finish_reason")
    return ModelResponse(
        output=output,
        finish_reason=finish if isinstance(finish, str) else None,
        usage=Usage(
            input_tokens=token_count(usage, "prompt_tokens"),
            output_tokens=token_count(usage, "completion_tokens"),
            reasoning_tokens=token_count(usage, "completion_tokens_details", "reasoning_tokens"),
            cache_read_tokens=token_count(usage, "prompt_tokens_details", "cached_tokens"),
        ),
    )
