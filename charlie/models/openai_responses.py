"""Responses API mapping: transcript items to ``input`` items and a response to output items.

Pure functions, no I/O; :mod:`charlie.models.openai` does the HTTP.

Requests are stateless (``store: false``) and ask for ``reasoning.encrypted_content``, so the
provider's reasoning items carry everything the next turn needs. They are kept whole in the
``reasoning`` payload's ``raw`` and replayed as they came, except for their ``id``: with
``store: false`` nothing was persisted under that id, and sending it makes the provider look it
up and fail ("Item with id 'rs_...' not found"); the encrypted content is self-contained. Assistant
messages are replayed the same way (from ``raw`` when the payload has it, else as an assistant
message), ``tool_call`` items as ``function_call`` items with the raw argument string, and a run of
``tool_result`` items as ``function_call_output`` items in the order of the calls they answer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from charlie.domain import JSON, Item, ItemKind, NewItem
from charlie.models.base import ModelRequest, ModelResponse, ToolSpec, Usage, tool_call_item
from charlie.models.openai_chat import (
    MalformedResponse,
    is_repeated_final,
    ordered_results,
    raw_arguments,
    token_count,
    unique_call_id,
)

log = logging.getLogger(__name__)

INCLUDE = ["reasoning.encrypted_content"]


def responses_tools(tools: Sequence[ToolSpec]) -> list[JSON]:
    return [
        {
            "type": "function",
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
            # the tools' schemas are plain JSON Schema, not the strict subset
            "strict": False,
        }
        for tool in tools
    ]


def responses_request_body(model: str, request: ModelRequest) -> JSON:
    body: JSON = {
        "model": model,
        "input": responses_input(request.items),
        "store": False,
        "include": list(INCLUDE),
    }
    if request.tools:
        body["tools"] = responses_tools(request.tools)
        body["parallel_tool_calls"] = True
    return body


def replayable(raw: JSON) -> JSON:
    """A provider output item as it goes back in ``input``: whole, minus its server-side id."""
    return {key: value for key, value in raw.items() if key != "id"}


def responses_input(items: Iterable[Item]) -> list[JSON]:
    entries: list[JSON] = []
    call_order: dict[str, int] = {}
    results: list[Item] = []
    previous: Item | None = None

    def flush_results() -> None:
        for result in ordered_results(results, call_order):
            entries.append(
                {
                    "type": "function_call_output",
                    "call_id": result.call_id,
                    "output": result.payload["content"],
                }
            )
        results.clear()

    for item in sorted(items, key=lambda i: i.seq):
        kind = item.kind
        payload = item.payload
        if kind is ItemKind.TOOL_RESULT:
            results.append(item)
            previous = item
            continue
        flush_results()
        if kind is ItemKind.INPUT:
            entries.append({"role": payload["role"], "content": payload["content"]})
        elif kind is ItemKind.REASONING:
            raw = payload.get("raw")
            if isinstance(raw, dict):
                entries.append(replayable(raw))
        elif kind is ItemKind.MESSAGE:
            raw = payload.get("raw")
            if isinstance(raw, dict) and raw.get("type") == "message":
                entries.append(replayable(raw))
            else:
                entries.append({"role": "assistant", "content": payload["content"]})
        elif kind is ItemKind.TOOL_CALL:
            call_order[item.call_id or ""] = len(call_order)
            entries.append(
                {
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": payload["name"],
                    "arguments": payload["raw_arguments"],
                }
            )
        elif kind is ItemKind.FINAL and not is_repeated_final(item, previous):
            entries.append({"role": "assistant", "content": payload["content"]})
        previous = item
    flush_results()
    return entries


def _summary(raw: JSON) -> str | None:
    parts = raw.get("summary")
    if not isinstance(parts, list):
        return None
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    joined = "\n\n".join(t for t in texts if isinstance(t, str) and t)
    return joined or None


def _message_text(raw: JSON) -> str:
    content = raw.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        text = part.get("text") if part.get("type") != "refusal" else part.get("refusal")
        if isinstance(text, str):
            texts.append(text)
    return "".join(texts)


def parse_response(data: Any) -> ModelResponse:
    if not isinstance(data, dict):
        raise MalformedResponse("the response is not a JSON object")
    if data.get("status") == "failed":
        raise MalformedResponse(f"the response failed: {data.get('error')!r}")
    entries = data.get("output")
    if not isinstance(entries, list):
        raise MalformedResponse("the response has no output list")
    output: list[NewItem] = []
    seen: set[str] = set()
    said = False
    calls = 0
    ignored: list[str] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise MalformedResponse(f"output item {index} is not an object")
        kind = entry.get("type")
        if kind == "reasoning":
            output.append(NewItem(ItemKind.REASONING, {"summary": _summary(entry), "raw": entry}))
        elif kind == "message":
            text = _message_text(entry)
            said = said or bool(text)
            output.append(
                NewItem(ItemKind.MESSAGE, {"role": "assistant", "content": text, "raw": entry})
            )
        elif kind == "function_call":
            name = entry.get("name")
            output.append(
                tool_call_item(
                    unique_call_id(entry.get("call_id"), index, seen),
                    name if isinstance(name, str) else "",
                    raw_arguments(entry.get("arguments")),
                )
            )
            calls += 1
        else:
            ignored.append(str(kind))
    if ignored:
        log.warning("ignored output items of types %s", ", ".join(ignored))
    if not said and not calls:
        detail = data.get("incomplete_details")
        raise MalformedResponse(
            "the model returned neither content nor tool calls "
            f"(status={data.get('status')!r}, incomplete_details={detail!r})"
        )
    usage = data.get("usage")
    return ModelResponse(
        output=output,
        finish_reason=_finish_reason(data, calls),
        usage=Usage(
            input_tokens=token_count(usage, "input_tokens"),
            output_tokens=token_count(usage, "output_tokens"),
            reasoning_tokens=token_count(usage, "output_tokens_details", "reasoning_tokens"),
            cache_read_tokens=token_count(usage, "input_tokens_details", "cached_tokens"),
        ),
    )


def _finish_reason(data: dict[str, Any], calls: int) -> str:
    """The Responses API has no finish reason: an incomplete response says why it stopped
    (``max_output_tokens``: "length", ``content_filter``), a complete one stopped or called."""
    detail = data.get("incomplete_details")
    reason = detail.get("reason") if isinstance(detail, dict) else None
    if reason == "max_output_tokens":
        return "length"
    if isinstance(reason, str) and reason:
        return reason
    return "tool_calls" if calls else "stop"
