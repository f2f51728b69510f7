"""A real HTTP server that speaks enough of the OpenAI API to test the clients against.

It listens on 127.0.0.1 (a free port), serves ``POST /v1/chat/completions`` and
``POST /v1/responses``, records every request (path, headers, JSON body) and answers each from a
queue of scripted :class:`Reply` objects, in order, whatever the path. With an empty queue it
answers 418, which the clients treat as a non-retryable error, so a test that sends more requests
than it scripted fails loudly.

    server = FakeOpenAI().start()
    server.enqueue(rate_limited(retry_after="0"), chat_text("hello"))
    ... client with CHARLIE_MODEL_BASE_URL=server.url ...
    server.stop()

Streams: a reply with ``events`` (server-sent event frames, see :func:`chat_stream` and
:func:`responses_stream`, which speak the two formats as OpenAI documents them) is sent as
``text/event-stream`` with chunked transfer encoding, one frame at a time. ``hold_at=N`` stops
after N frames until ``release`` is set (a stall, while a test looks at what was streamed so
far; ``reached`` is set when it gets there); ``cut_at=N`` drops the connection after N frames,
without the chunked body's end (a stream cut mid-way).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from charlie.executor.context import SUMMARY_PROMPT


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any
    raw: bytes


@dataclass
class Reply:
    status: int = 200
    #: a JSON value, a ``str``/``bytes`` sent as is, or a function of the recorded request.
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    #: seconds to wait before answering (to outlast the client's read timeout).
    delay: float = 0.0
    #: server-sent event frames: the reply is a stream of them
    events: list[str] | None = None
    hold_at: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)
    #: how long a hold lasts at most (then the stream goes on)
    hold_seconds: float = 120.0
    cut_at: int | None = None


@dataclass
class ProviderLimit:
    """What the fake provider allows, as OpenAI enforces an account's limits: a request over
    ``concurrency`` in flight or ``rpm`` arrivals in the last minute is refused with 429 and
    ``retry-after`` (seconds), and never served. Admitted requests are answered from the queue
    or, when it is empty, by ``answer`` (a function of the recorded request), after
    ``latency`` seconds."""

    concurrency: int | None = None
    rpm: int | None = None
    retry_after: str = "1"
    latency: float = 0.0
    answer: Any = None
    #: what it measured: the most requests in flight at once, the refusals, and each
    #: admitted request as (arrival, monotonic seconds; the recorded request)
    peak: int = 0
    refusals: int = 0
    admitted: list[tuple[float, Recorded]] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    in_flight: int = 0
    #: refuse the next N admissible requests too (a provider that says 429 for its own reasons)
    refuse_next: int = 0


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
        recorded = Recorded(
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
            raw=raw,
        )
        fake = self.server.fake
        counted = len(raw) // 4  # the window's count: every byte of the request, 4 a token
        limit = fake.limit
        admitted = False
        refused: Reply | None = None
        with fake.lock:
            fake.requests.append(recorded)
            if limit is not None:
                admitted = self._admit(limit, recorded)
                if not admitted:
                    refused = rate_limited(limit.retry_after)
            if refused is not None:
                reply: Reply | None = refused
            elif fake.window is not None and counted > fake.window:
                # as OpenAI refuses an input over the model's window (the request is not served)
                fake.refused.append(recorded)
                reply = context_length_error(fake.window, counted)
            elif _SUMMARY_MARK in raw.decode("utf-8", "replace"):
                # a compaction's summary call: answered here, apart from the scripted turns
                fake.summaries.append(recorded)
                reply = chat_text(f"summary {len(fake.summaries)} of the work so far")
                reply.delay = fake.summary_delay
                fake.summary_started.set()
            else:
                reply = fake.queue.popleft() if fake.queue else None
            if reply is not None and fake.window is not None and isinstance(reply.body, dict):
                reply = _with_prompt_tokens(reply, counted)
        if reply is None and limit is not None and admitted and limit.answer is not None:
            reply = limit.answer(recorded)
        if admitted and reply is not None:
            assert limit is not None
            reply.delay = max(reply.delay, limit.latency)
        try:
            self._answer(recorded, reply)
        finally:
            if admitted:
                assert limit is not None
                with fake.lock:
                    limit.in_flight -= 1

    def _admit(self, limit: ProviderLimit, recorded: Recorded) -> bool:
        now = time.monotonic()
        recent = sum(1 for at, _ in limit.admitted if at > now - 60.0)
        over = (limit.concurrency is not None and limit.in_flight >= limit.concurrency) or (
            limit.rpm is not None and recent >= limit.rpm
        )
        if over or limit.refuse_next > 0:
            limit.refuse_next = max(0, limit.refuse_next - 1)
            limit.refusals += 1
            limit.refused_at.append(now)
            return False
        limit.in_flight += 1
        limit.peak = max(limit.peak, limit.in_flight)
        limit.admitted.append((now, recorded))
        return True

    def _answer(self, recorded: Recorded, reply: Reply | None) -> None:
        if reply is None:
            reply = Reply(418, {"error": {"message": f"fake: nothing scripted for {self.path}"}})
        if self.path not in ("/v1/chat/completions", "/v1/responses"):
            reply = Reply(404, {"error": {"message": f"fake: no route {self.path}"}})
        if reply.delay:
            time.sleep(reply.delay)
        if reply.events is not None and reply.status == 200:
            self._stream(reply)
            return
        content = reply.body(recorded) if callable(reply.body) else reply.body
        if isinstance(content, str):
            data = content.encode()
        elif isinstance(content, bytes):
            data = content
        else:
            data = json.dumps(content).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up waiting (a timeout test)

    def _stream(self, reply: Reply) -> None:
        events = reply.events or []
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            for index, frame in enumerate(events):
                if index == reply.hold_at:
                    reply.reached.set()
                    reply.release.wait(reply.hold_seconds)
                if index == reply.cut_at:
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                data = frame.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            reply.reached.set()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeOpenAI


class FakeOpenAI:
    def __init__(self, port: int = 0) -> None:
        #: 0 picks a free port; a fixed one lets worker processes be configured before start().
        self.requested_port = port
        self.lock = threading.Lock()
        self.requests: list[Recorded] = []
        self.queue: deque[Reply] = deque()
        #: the model's context window in tokens (len(body) // 4): a request over it is refused
        #: with OpenAI's 400 ``context_length_exceeded``; None: no window
        self.window: int | None = None
        self.refused: list[Recorded] = []
        #: compaction summary calls (answered without the queue)
        self.summaries: list[Recorded] = []
        #: seconds a summary call's answer takes; set when one arrives
        self.summary_delay = 0.0
        self.summary_started = threading.Event()
        #: an account's limits, enforced (None: none)
        self.limit: ProviderLimit | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the server first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The base URL clients use: ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> FakeOpenAI:
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
            self.refused.clear()
            self.summaries.clear()
            self.window = None
            self.summary_delay = 0.0
            self.summary_started.clear()
            self.limit = None

    @property
    def bodies(self) -> list[Any]:
        return [r.body for r in self.requests]

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- scripted replies ------------------------------------------------------------------------


def usage_chat(prompt: int = 10, completion: int = 5, reasoning: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def chat_completion(message: dict[str, Any], usage: dict[str, Any] | None = None) -> Reply:
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return Reply(
        body={
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": "fake",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage if usage is not None else usage_chat(),
        }
    )


def chat_text(text: str, usage: dict[str, Any] | None = None) -> Reply:
    return chat_completion({"role": "assistant", "content": text}, usage)


def chat_tool_calls(
    calls: list[tuple[str | None, str, str]],
    text: str | None = None,
    usage: dict[str, Any] | None = None,
) -> Reply:
    """Parallel tool calls; each is ``(id or None, name, raw argument string)``."""
    tool_calls = []
    for call_id, name, arguments in calls:
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if call_id is not None:
            call["id"] = call_id
        tool_calls.append(call)
    return chat_completion({"role": "assistant", "content": text, "tool_calls": tool_calls}, usage)


def empty_choices() -> Reply:
    return Reply(body={"id": "chatcmpl-fake", "object": "chat.completion", "choices": []})


def usage_responses(inp: int = 10, out: int = 5, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": inp,
        "output_tokens": out,
        "total_tokens": inp + out,
        "output_tokens_details": {"reasoning_tokens": reasoning},
    }


def reasoning_item(
    item_id: str, summary: str | None = None, encrypted: str = "gAAAA-opaque"
) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [{"type": "summary_text", "text": summary}] if summary else [],
        "encrypted_content": encrypted,
    }


def message_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call_item(
    item_id: str, call_id: str | None, name: str, arguments: str
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "function_call",
        "id": item_id,
        "status": "completed",
        "name": name,
        "arguments": arguments,
    }
    if call_id is not None:
        item["call_id"] = call_id
    return item


def response(
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    status: str = "completed",
) -> Reply:
    return Reply(
        body={
            "id": "resp_fake",
            "object": "response",
            "status": status,
            "model": "fake",
            "output": output,
            "usage": usage if usage is not None else usage_responses(),
        }
    )


def error(status: int, message: str, code: str | None = None, **headers: str) -> Reply:
    return Reply(
        status,
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        headers={k.replace("_", "-"): v for k, v in headers.items()},
    )


def rate_limited(retry_after: str | None = None) -> Reply:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return Reply(
        429,
        {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit"}},
        headers=headers,
    )


def server_error(status: int = 500) -> Reply:
    return Reply(status, {"error": {"message": "The server had an error", "type": "server_error"}})


def context_length_error(window: int = 128000, sent: int = 130000) -> Reply:
    """OpenAI's refusal of an input over the model's window, in its real shape."""
    reply = error(
        400,
        f"This model's maximum context length is {window} tokens. However, your messages "
        f"resulted in {sent} tokens. Please reduce the length of the messages.",
        code="context_length_exceeded",
    )
    reply.body["error"]["param"] = "messages"
    return reply


#: what marks a compaction's summary call (its system prompt, as JSON carries it)
_SUMMARY_MARK = json.dumps(SUMMARY_PROMPT)[1:-1]


def _with_prompt_tokens(reply: Reply, counted: int) -> Reply:
    """A reply whose usage reports the input as this window counted it (as a provider's does)."""
    body = json.loads(json.dumps(reply.body))
    usage = body.get("usage")
    if isinstance(usage, dict):
        if "prompt_tokens" in usage:
            usage["prompt_tokens"] = counted
            usage["total_tokens"] = counted + int(usage.get("completion_tokens", 0))
        elif "input_tokens" in usage:
            usage["input_tokens"] = counted
    return Reply(reply.status, body, dict(reply.headers), delay=reply.delay)


def slow(reply: Reply, seconds: float) -> Reply:
    return Reply(reply.status, reply.body, dict(reply.headers), delay=seconds)


def echoing_auth(status: int) -> Reply:
    """An error body that quotes the request's Authorization header back (as a careless proxy
    might), to prove the client redacts the key."""

    def body(request: Recorded) -> dict[str, Any]:
        auth = request.headers.get("authorization", "")
        return {"error": {"message": f"Incorrect API key provided: {auth}", "code": "bad_key"}}

    return Reply(status, body)


# -- streams -----------------------------------------------------------------------------------


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event frame."""
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in text.split("\n")) + "\n"


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def chat_stream(
    text: str | None = None,
    calls: list[tuple[str, str, str]] | None = None,
    *,
    reasoning: str | None = None,
    usage: dict[str, Any] | None = None,
    size: int = 4,
    **options: Any,
) -> Reply:
    """A streamed chat completion as OpenAI sends one: a first chunk with the role, the text
    (and ``reasoning_content``) in pieces of ``size`` characters, each tool call's first
    fragment with its id and name then its arguments in pieces, a chunk with the finish reason,
    the usage chunk (no choices; ``stream_options.include_usage``), ``[DONE]``."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "fake",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    frames = [chunk({"role": "assistant", "content": ""})]
    for piece in pieces(reasoning, size) if reasoning else []:
        frames.append(chunk({"reasoning_content": piece}))
    for piece in pieces(text, size) if text else []:
        frames.append(chunk({"content": piece}))
    for index, (call_id, name, arguments) in enumerate(calls or []):
        first = {"index": index, "id": call_id, "type": "function"}
        opening = {**first, "function": {"name": name, "arguments": ""}}
        frames.append(chunk({"tool_calls": [opening]}))
        for piece in pieces(arguments, size):
            fragment = {"index": index, "function": {"arguments": piece}}
            frames.append(chunk({"tool_calls": [fragment]}))
    frames.append(chunk({}, "tool_calls" if calls else "stop"))
    frames.append(
        sse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": usage if usage is not None else usage_chat(),
            }
        )
    )
    frames.append(sse("[DONE]"))
    return Reply(events=frames, **options)


def responses_stream(
    output: list[dict[str, Any]],
    *,
    usage: dict[str, Any] | None = None,
    size: int = 4,
    status: str = "completed",
    **options: Any,
) -> Reply:
    """A streamed response as OpenAI sends one: ``response.created``, then per output item
    ``response.output_item.added``, its deltas (``response.output_text.delta``,
    ``response.reasoning_summary_text.delta``, ``response.function_call_arguments.delta``) and
    ``response.output_item.done``, then ``response.completed`` with the whole response."""
    seq = iter(range(1_000_000))
    whole = {
        "id": "resp_fake",
        "object": "response",
        "status": status,
        "model": "fake",
        "output": output,
        "usage": usage if usage is not None else usage_responses(),
    }

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    frames = [event("response.created", response={**whole, "status": "in_progress", "output": []})]
    for index, item in enumerate(output):
        item_id = item.get("id", f"item_{index}")
        added = dict(item)
        kind = item.get("type")
        if kind == "function_call":
            added["arguments"] = ""
        elif kind == "message":
            added["content"] = []
        elif kind == "reasoning":
            added["summary"] = []
        frames.append(event("response.output_item.added", output_index=index, item=added))
        if kind == "message":
            for part in item.get("content", []):
                for piece in pieces(part.get("text", ""), size):
                    frames.append(
                        event(
                            "response.output_text.delta",
                            item_id=item_id,
                            output_index=index,
                            content_index=0,
                            delta=piece,
                        )
                    )
        elif kind == "reasoning":
            for n, part in enumerate(item.get("summary", [])):
                for piece in pieces(part.get("text", ""), size):
                    frames.append(
                        event(
                            "response.reasoning_summary_text.delta",
                            item_id=item_id,
                            output_index=index,
                            summary_index=n,
                            delta=piece,
                        )
                    )
        elif kind == "function_call":
            for piece in pieces(item.get("arguments", ""), size):
                frames.append(
                    event(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=piece,
                    )
                )
        frames.append(event("response.output_item.done", output_index=index, item=item))
    final = "response.completed" if status == "completed" else f"response.{status}"
    frames.append(event(final, response=whole))
    return Reply(events=frames, **options)
