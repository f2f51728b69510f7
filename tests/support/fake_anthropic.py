"""A real HTTP server that speaks Anthropic's Messages API, to test the ``anthropic:`` client
against, through the official SDK and through real workers.

It listens on 127.0.0.1, serves ``POST /v1/messages`` as JSON or, when the body asks for
``"stream": true``, as the documented SSE event stream (``message_start``,
``content_block_start``/``_delta``/``_stop`` with ``text_delta``, ``thinking_delta``,
``signature_delta`` and ``input_json_delta``, ``ping``, ``message_delta`` with ``stop_reason`` and
usage, ``message_stop``). Errors are ``{"type": "error", "error": {"type": ..., "message": ...}}``.

Like the real API it refuses (400 ``invalid_request_error``, answering from no script):
a request without its key in ``x-api-key`` or ``Authorization: Bearer`` (which SDK 2.x sends)
(401) or without ``anthropic-version``; roles
that do not alternate; an assistant ``tool_use`` not answered by a ``tool_result`` for each call,
first in the next user message; more than 4 ``cache_control`` breakpoints; and a tool loop whose
assistant turn does not carry back, unchanged and first, the thinking blocks (signatures
included) this server sent with those tool calls.

Every request is recorded; replies come from a queue of :class:`Reply` scripted per test, in
order; an empty queue answers 418 (not retried), so an unscripted call fails loudly.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from charlie.executor.context import SUMMARY_PROMPT

#: what marks a compaction's summary call (its system prompt, as JSON carries it)
_SUMMARY_MARK = json.dumps(SUMMARY_PROMPT)[1:-1]

FAKE_ANTHROPIC_KEY = "sk-ant-charlie-test-9876543210"
VERSION_HEADER = "anthropic-version"


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Reply:
    """A message (``content`` blocks, ``stop_reason``, ``usage``) or an error (``status`` not
    200, ``error_type``, ``message``). ``break_after``: send that many SSE events, then drop the
    connection (a stream broken mid-way); ``error_event``: a 200 stream that sends an ``error``
    event of that type after ``message_start``."""

    status: int = 200
    content: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = "end_turn"
    usage: dict[str, Any] = field(default_factory=dict)
    error_type: str = ""
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    break_after: int | None = None
    error_event: str | None = None
    delay: float = 0.0


def _error(status: int, error_type: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"type": "error", "error": {"type": error_type, "message": message}}


def _chunks(text: str, size: int = 7) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in self.headers.items()}
        fake = self.server.fake
        with fake.lock:
            fake.requests.append(Recorded(self.path, headers, body))
        refused = fake.refusal(self.path, headers, body)
        if refused is not None:
            self._json(*refused)
            return
        counted = len(raw) // 4  # the window's count: every byte of the request, 4 a token
        with fake.lock:
            number = len(fake.requests)
            if fake.window is not None and counted > fake.window:
                # as Anthropic refuses a prompt over the model's window
                fake.refused.append(fake.requests[-1])
                reply = None
            elif _SUMMARY_MARK in raw.decode("utf-8", "replace"):
                # a compaction's summary call: answered here, apart from the scripted turns
                fake.summaries.append(fake.requests[-1])
                said = f"summary {len(fake.summaries)} of the work so far"
                reply = Reply(content=[{"type": "text", "text": said}])
            else:
                reply = fake.queue.popleft() if fake.queue else None
        if fake.window is not None and counted > fake.window:
            too_long = f"prompt is too long: {counted} tokens > {fake.window} maximum"
            self._json(*_error(400, "invalid_request_error", too_long))
            return
        if reply is not None and fake.window is not None:
            reply = Reply(**{**reply.__dict__, "usage": {**reply.usage, "input_tokens": counted}})
        if reply is None:
            self._json(*_error(418, "not_found_error", "fake: nothing scripted"))
            return
        if reply.delay:
            time.sleep(reply.delay)
        if reply.status != 200:
            status, doc = _error(reply.status, reply.error_type, reply.message)
            self._json(status, doc, reply.headers)
            return
        message = fake.message_of(reply, body, number)
        if isinstance(body, dict) and body.get("stream"):
            self._stream(message, reply)
        else:
            self._json(200, message, reply.headers)

    def _json(self, status: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(doc).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("request-id", "req_fake")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _stream(self, message: dict[str, Any], reply: Reply) -> None:
        raws = {i: b["_raw_input"] for i, b in enumerate(reply.content) if "_raw_input" in b}
        events = sse_events(message, raws)
        if reply.error_event:
            events = [
                events[0],
                (
                    "error",
                    {
                        "type": "error",
                        "error": {"type": reply.error_event, "message": "Overloaded"},
                    },
                ),
            ]
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("request-id", "req_fake")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            for sent, (name, data) in enumerate(events):
                if reply.break_after is not None and sent >= reply.break_after:
                    # drop the connection mid-body: no terminating chunk
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                chunk = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True


def sse_events(
    message: dict[str, Any], raw_inputs: dict[int, str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """A complete message as the documented stream of events; ``raw_inputs``: a tool_use's
    argument string as streamed, by block index (else its input as JSON)."""
    raw_inputs = raw_inputs or {}
    usage = message["usage"]
    start_usage = {k: v for k, v in usage.items() if k != "output_tokens_details"}
    start_usage["output_tokens"] = 1
    events: list[tuple[str, dict[str, Any]]] = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {**message, "content": [], "stop_reason": None, "usage": start_usage},
            },
        ),
        ("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        deltas: list[dict[str, Any]] = []
        if kind == "text":
            start = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": t} for t in _chunks(block["text"])]
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": t} for t in _chunks(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            raw = raw_inputs.get(index, json.dumps(block["input"]))
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _chunks(raw, 5)]
        else:  # redacted_thinking and the rest come whole
            start = block
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": start},
            )
        )
        for delta in deltas:
            events.append(
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta_usage: dict[str, Any] = {"output_tokens": usage["output_tokens"]}
    if "output_tokens_details" in usage:
        delta_usage["output_tokens_details"] = usage["output_tokens_details"]
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": delta_usage,
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeAnthropic


class FakeAnthropic:
    def __init__(self, port: int = 0, key: str = FAKE_ANTHROPIC_KEY) -> None:
        self.requested_port = port
        self.key = key
        self.lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.queue: deque[Reply] = deque()
        #: the model's context window in tokens (len(body) // 4): a request over it is refused
        #: as Anthropic refuses it (400, "prompt is too long"); None: no window
        self.window: int | None = None
        self.refused: list[Recorded] = []
        #: compaction summary calls (answered without the queue)
        self.summaries: list[Recorded] = []
        #: tool_use id -> the thinking blocks sent with it (what a tool loop must send back)
        self.thinking_of_call: dict[str, list[dict[str, Any]]] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the server first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The base URL (``ANTHROPIC_BASE_URL``): ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeAnthropic:
        server = _Server(("127.0.0.1", self.requested_port), _Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def enqueue(self, *replies: Reply) -> None:
        with self.lock:
            self.queue.extend(replies)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.queue.clear()
            self.thinking_of_call.clear()
            self.refused.clear()
            self.summaries.clear()
            self.window = None

    @property
    def bodies(self) -> list[Any]:
        return [r.body for r in self.requests]

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the API's rules ------------------------------------------------------------------------

    def message_of(self, reply: Reply, body: Any, number: int) -> dict[str, Any]:
        content = [{k: v for k, v in b.items() if k != "_raw_input"} for b in reply.content]
        thinking = [b for b in content if b["type"] in ("thinking", "redacted_thinking")]
        with self.lock:
            for block in content:
                if block["type"] == "tool_use" and thinking:
                    self.thinking_of_call[block["id"]] = thinking
        usage = {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            **reply.usage,
        }
        return {
            "id": f"msg_fake_{number}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model") if isinstance(body, dict) else "fake",
            "content": content,
            "stop_reason": reply.stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }

    def refusal(self, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any] | None:
        if path != "/v1/messages":
            return _error(404, "not_found_error", f"fake: no route {path}")
        # the key in x-api-key, or (as the SDK 2.x sends it) in Authorization: Bearer
        bearer = headers.get("authorization", "").removeprefix("Bearer ")
        if self.key not in (headers.get("x-api-key"), bearer):
            return _error(401, "authentication_error", "invalid x-api-key")
        if not headers.get(VERSION_HEADER):
            return _error(400, "invalid_request_error", "anthropic-version header is required")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "invalid_request_error", "messages: field required")
        if not isinstance(body.get("max_tokens"), int):
            return _error(400, "invalid_request_error", "max_tokens: field required")
        problem = self._check(body)
        return None if problem is None else _error(400, "invalid_request_error", problem)

    def _check(self, body: dict[str, Any]) -> str | None:
        messages = body["messages"]
        breakpoints = sum(1 for b in _blocks(body) if isinstance(b, dict) and "cache_control" in b)
        if breakpoints > 4:
            return f"A maximum of 4 blocks with cache_control may be provided. Found {breakpoints}."
        for i, message in enumerate(messages):
            want = "user" if i % 2 == 0 else "assistant"
            if message.get("role") != want:
                return f"messages.{i}: roles must alternate, starting with user"
            content = message.get("content")
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "text" and not b.get("text")
                for b in content
            ):
                return f"messages.{i}: text content blocks must be non-empty"
            if want != "assistant" or not isinstance(content, list):
                continue
            calls = [b["id"] for b in content if b.get("type") == "tool_use"]
            if not calls:
                continue
            after = messages[i + 1]["content"] if i + 1 < len(messages) else None
            if after is None:
                continue  # a turn being continued (pause_turn)
            answered = [
                b.get("tool_use_id")
                for b in after
                if isinstance(b, dict) and b.get("type") == "tool_result"
            ]
            firsts = [b.get("type") for b in after[: len(answered)] if isinstance(b, dict)]
            if answered != calls or set(firsts) != {"tool_result"}:
                return (
                    f"messages.{i + 1}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: expected {calls}, got {answered}"
                )
            with self.lock:
                sent = self.thinking_of_call.get(calls[0])
            if sent:
                got = [
                    {k: v for k, v in b.items() if k != "cache_control"}
                    for b in content[: len(sent)]
                ]
                if got != sent:
                    return (
                        f"messages.{i}.content.0: when thinking is enabled, an assistant "
                        "message in a tool loop must start with the thinking blocks it was "
                        "sent, unchanged, signatures included"
                    )
        return None


def _blocks(body: dict[str, Any]) -> list[Any]:
    found: list[Any] = []
    for key in ("system", "tools"):
        value = body.get(key)
        if isinstance(value, list):
            found.extend(value)
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(content)
    return found


# -- scripted replies ------------------------------------------------------------------------


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def thinking(value: str, signature: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": value, "signature": signature}


def redacted_thinking(data: str) -> dict[str, Any]:
    return {"type": "redacted_thinking", "data": data}


def tool_use(call_id: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A tool call; a string is streamed as the raw argument JSON (may be malformed)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = {}
        return {
            "type": "tool_use",
            "id": call_id,
            "name": name,
            "input": parsed,
            "_raw_input": arguments,
        }
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def usage(
    inp: int = 10,
    out: int = 5,
    cache_read: int = 0,
    cache_write: int = 0,
    thinking_tokens: int | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "input_tokens": inp,
        "output_tokens": out,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }
    if thinking_tokens is not None:
        doc["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return doc


def message(
    *content: dict[str, Any], stop_reason: str | None = None, use: dict[str, Any] | None = None
) -> Reply:
    if stop_reason is None:
        stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"
    return Reply(content=list(content), stop_reason=stop_reason, usage=use or {})


def error(status: int, error_type: str, message: str = "error", **headers: str) -> Reply:
    return Reply(
        status=status,
        error_type=error_type,
        message=message,
        headers={k.replace("_", "-"): v for k, v in headers.items()},
    )


def overloaded(retry_after: str | None = None) -> Reply:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return Reply(status=529, error_type="overloaded_error", message="Overloaded", headers=headers)


def rate_limited(retry_after: str | None = None) -> Reply:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return Reply(
        status=429,
        error_type="rate_limit_error",
        message="Number of request tokens has exceeded your per-minute rate limit",
        headers=headers,
    )


def broken(reply: Reply, after: int = 4) -> Reply:
    """The reply's stream, dropped after ``after`` events."""
    return Reply(
        content=reply.content, stop_reason=reply.stop_reason, usage=reply.usage, break_after=after
    )
