"""Streamed answers of OpenAI-compatible endpoints: the events the ``openai`` SDK decodes from
the server-sent event stream (each a JSON object as the server sent it), deltas out, and the
whole answer rebuilt from the whole stream.

Pure, no I/O: :mod:`charlie.models.openai` reads the stream through the SDK and feeds its events
here.

- Chat Completions (``stream: true``, ``stream_options.include_usage``): ``chat.completion.chunk``
  objects, each with a first choice whose ``delta`` carries a piece of ``content`` (or
  ``reasoning_content``) or ``tool_calls`` fragments (by ``index``: the first has the ``id`` and
  the function's ``name``, the rest pieces of ``arguments``); a last chunk with no choices
  carries the usage; ``data: [DONE]`` ends the stream (the SDK stops there). The pieces are put
  together into the ``chat.completion`` :func:`parse_chat_completion` reads. The stream is whole
  once a chunk gave the finish reason and the stream then ended.
- Responses (``stream: true``): typed events; ``response.output_text.delta``,
  ``response.reasoning_summary_text.delta`` and ``response.function_call_arguments.delta``
  (its call named by the ``response.output_item.added`` before it) are only shown to people;
  the answer is the response ``response.completed`` (or ``response.incomplete``) carries whole.

A stream that stops before its end is no answer (I16): the client treats it as a transient
failure and asks again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from charlie.models.base import Deltas


class StreamFailed(Exception):
    """The provider reported an error inside the stream."""

    def __init__(self, message: str, *, code: str | None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _ChatCall:
    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class ChatStream:
    """Chat Completions chunks -> deltas, then the ``chat.completion`` they add up to."""

    def __init__(self, deltas: Deltas) -> None:
        self.deltas = deltas
        self.done = False
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, _ChatCall] = {}
        self._finish: str | None = None
        self._usage: Any = None
        self._id: Any = None

    def feed(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        self._id = chunk.get("id", self._id)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if isinstance(choice.get("finish_reason"), str):
            self._finish = choice["finish_reason"]
            self.done = True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        text = delta.get("content")
        if isinstance(text, str) and text:
            self._content.append(text)
            self.deltas.text(text)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._refusal.append(refusal)
            self.deltas.text(refusal)
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(thought, str) and thought:
            self._reasoning.append(thought)
            self.deltas.reasoning(thought)
        for position, fragment in enumerate(delta.get("tool_calls") or []):
            if isinstance(fragment, dict):
                self._tool_fragment(position, fragment)

    def _tool_fragment(self, position: int, fragment: dict[str, Any]) -> None:
        index = fragment.get("index")
        index = index if isinstance(index, int) else position
        call = self._calls.setdefault(index, _ChatCall())
        if isinstance(fragment.get("id"), str) and fragment["id"]:
            call.id = fragment["id"]
        function = fragment.get("function")
        function = function if isinstance(function, dict) else {}
        if isinstance(function.get("name"), str) and function["name"]:
            call.name += function["name"]
        piece = function.get("arguments")
        if isinstance(piece, str):
            call.arguments.append(piece)
            self.deltas.tool_call(call.id or f"call_{index}", call.name or None, piece)

    def answer(self) -> dict[str, Any]:
        """The ``chat.completion`` the whole stream adds up to."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._refusal:
            message["refusal"] = "".join(self._refusal)
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            calls = []
            for index in sorted(self._calls):
                call = self._calls[index]
                entry: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": call.name, "arguments": "".join(call.arguments)},
                }
                if call.id:
                    entry["id"] = call.id
                calls.append(entry)
            message["tool_calls"] = calls
        return {
            "id": self._id,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish}],
            "usage": self._usage,
        }


class ResponsesStream:
    """Responses events -> deltas; the answer is the response the last event carries."""

    FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

    def __init__(self, deltas: Deltas) -> None:
        self.deltas = deltas
        self.done = False
        self.response: Any = None
        #: function_call items by id: (call_id, name), from response.output_item.added
        self._calls: dict[str, tuple[str, str | None]] = {}

    def feed(self, event: Any) -> None:
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if kind == "error":
            code = event.get("code") or event.get("type")
            message = event.get("message")
            raise StreamFailed(
                f"the stream reported an error: {message if isinstance(message, str) else event!r}",
                code=code if isinstance(code, str) else None,
            )
        if kind in self.FINAL:
            self.response = event.get("response")
            self.done = True
            return
        delta = event.get("delta")
        if kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                item_id = str(item.get("id") or event.get("output_index"))
                call_id = item.get("call_id")
                name = item.get("name")
                self._calls[item_id] = (
                    call_id if isinstance(call_id, str) else item_id,
                    name if isinstance(name, str) else None,
                )
        elif not isinstance(delta, str) or not delta:
            return
        elif kind == "response.output_text.delta" or kind == "response.refusal.delta":
            self.deltas.text(delta)
        elif kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            self.deltas.reasoning(delta)
        elif kind == "response.function_call_arguments.delta":
            item_id = str(event.get("item_id") or event.get("output_index"))
            call_id, name = self._calls.get(item_id, (item_id, None))
            self.deltas.tool_call(call_id, name, delta)

    def answer(self) -> Any:
        return self.response
