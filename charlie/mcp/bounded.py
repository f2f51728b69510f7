"""What an MCP server sends, read with a bound on what is held of it.

A server is outside Charlie's control, and so is the size of what it writes: a line of stderr, a
JSON-RPC message over stdio, a JSON body over HTTP. The SDK reads each of those whole (its stdio
transport joins a message's chunks until a newline comes; its HTTP transport reads a JSON body
to its end), so a server that writes gigabytes without a newline would have a worker hold them
all. Here every read is bounded while it happens (result cap, I15):

- stderr lines are cut at :data:`STDERR_LINE_BYTES`; the rest of a long line is dropped as it
  arrives (:func:`forward_stderr`);
- over stdio, a message longer than the limit is never held: its head and tail are kept (a few
  KiB), the rest is counted and dropped, and the request it answers gets an error of its own
  (:data:`OVERSIZED`) in its place (:func:`stdio_client`);
- over HTTP, a JSON body is read up to the limit; a longer one (or one that says it is) is not
  read on, and the request gets the same error (:class:`BoundedTransport`). An SSE event is
  bounded by the SDK itself over streamable HTTP (``max_sse_event_size``, given the same
  limit); over the SSE transport, whose SDK client takes no limit, the event stream is cut
  here (:class:`_EventBounded`): an event over the limit ends the stream, the SDK's own words
  for it (:func:`sse_over_limit`), so its request fails as too large.

What is not bounded here: what the SDK makes of a message within the limit (a parsed message is
a few times its size), and a server's request or notification over the limit, which is dropped
(logged) with nothing to answer.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import anyio
import anyio.lowlevel
import httpx2
import mcp_types
from mcp.client import stdio as sdk_stdio
from mcp.client._transport import TransportStreams
from mcp.client.stdio import StdioServerParameters, get_default_environment
from mcp.shared.message import SessionMessage

from charlie.terminal import printable

log = logging.getLogger("charlie.mcp")

#: the error code a request gets when the server's answer to it was over the limit (in the
#: JSON-RPC range left to implementations, clear of the codes MCP uses).
OVERSIZED = -32070
#: a line of a server's stderr is kept up to this many bytes, and cut there.
STDERR_LINE_BYTES = 8 * 1024
#: how much of an oversized message's start and end is kept, to find the request it answers.
_EDGE = 4096
#: how much one read of a pipe takes.
_CHUNK = 256 * 1024


def oversized_reason(total: int, limit: int, complete: bool = True) -> str:
    size = f"{total} bytes" if complete else f"more than {limit} bytes"
    return (
        f"its answer was {size}, over the limit of {limit} bytes on one MCP message "
        "(CHARLIE_MCP_MAX_MESSAGE_BYTES); it was dropped unread"
    )


#: how the SDK's SSE reader says an event was over its limit (httpx2.SSEError's message; the
#: SDK turns it into a CONNECTION_CLOSED error for the request it was answering).
_SSE_OVER = re.compile(r"Server-sent event exceeded the (\d+) byte limit")


def sse_over_limit(message: str) -> int | None:
    """The limit an SSE event went over, when ``message`` (a CONNECTION_CLOSED error's) says
    that is why the request's answer never came; None otherwise."""
    found = _SSE_OVER.search(message)
    return int(found.group(1)) if found else None


# -- lines ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Oversized:
    """A line over the limit, as far as it was kept: its length, start and end."""

    total: int
    head: bytes
    tail: bytes


class LineCutter:
    """Splits a byte stream into lines (without their newline) of at most ``limit`` bytes. A
    longer line is an :class:`Oversized`: only its first and last :data:`_EDGE` bytes are kept
    while the rest goes by, so what is held never exceeds ``limit`` plus a few KiB."""

    def __init__(self, limit: int, edge: int = _EDGE) -> None:
        self.limit = limit
        self.edge = edge
        self._line = bytearray()
        self._over = False
        self._total = 0
        self._head = b""
        self._tail = bytearray()

    def feed(self, data: bytes) -> list[bytes | Oversized]:
        found: list[bytes | Oversized] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            self._take(data[start:] if end < 0 else data[start:end])
            if end < 0:
                return found
            found.append(self._end())
            start = end + 1

    def flush(self) -> list[bytes | Oversized]:
        """The last line, if the stream ended without a newline."""
        if not self._over and not self._line:
            return []
        return [self._end()]

    def _take(self, piece: bytes) -> None:
        if not piece:
            return
        edge = self.edge
        if not self._over:
            if len(self._line) + len(piece) <= self.limit:
                self._line += piece
                return
            self._over = True
            self._total = len(self._line)
            self._head = bytes(self._line[:edge]) + piece[: max(0, edge - len(self._line))]
            self._tail, self._line = self._line, bytearray()
        self._total += len(piece)
        self._tail += piece[-edge:]
        del self._tail[:-edge]

    def _end(self) -> bytes | Oversized:
        if self._over:
            done: bytes | Oversized = Oversized(self._total, self._head, bytes(self._tail))
        else:
            done = bytes(self._line)
        self._line = bytearray()
        self._over, self._total, self._head, self._tail = False, 0, b"", bytearray()
        return done


# -- stderr -----------------------------------------------------------------------------------


def forward_stderr(read_fd: int, scrub: Callable[[str], str], secret_bytes: int) -> None:
    """Copy a server's stderr to this process's (fd 2), line by line, each line scrubbed of
    the configuration's secrets and cut at :data:`STDERR_LINE_BYTES`. A line is scrubbed with
    ``secret_bytes`` (the longest secret's length) more of it than is kept, so a secret that
    straddles the cut is blanked before it is cut, not cut in two."""
    keep = STDERR_LINE_BYTES
    cutter = LineCutter(keep + secret_bytes, edge=keep + secret_bytes)
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            try:
                chunk = pipe.read(_CHUNK)
            except OSError:
                chunk = b""
            lines = cutter.feed(chunk) if chunk else cutter.flush()
            for line in lines:
                if isinstance(line, Oversized):
                    text = scrub(line.head.decode(errors="replace"))
                    text = f"{text[:keep]}... [line cut: {line.total} bytes]"
                else:
                    text = scrub(line.decode(errors="replace"))
                    if len(text) > keep:
                        text = f"{text[:keep]}... [line cut: {len(line)} bytes]"
                # shown, not obeyed, by whoever tails the worker's log (charlie.terminal)
                text = printable(text, multiline=True)
                _write_all(2, (text + "\n").encode(errors="replace"))
            if not chunk:
                return


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # no stderr here: what the server says is dropped, as it would be


# -- which request an oversized message answers ------------------------------------------------

_ID = r'(-?\d+|"(?:[^"\\]|\\.){0,200}")'
_VERSION = r'"jsonrpc"\s*:\s*"2\.0"\s*,\s*'
#: a response that names its id first: {"jsonrpc":"2.0","id":7,"result":... (the Python SDK's)
_ID_FIRST = re.compile(
    rb"^\s*\{\s*(?:"
    + _VERSION.encode()
    + rb')?"id"\s*:\s*'
    + _ID.encode()
    + rb"\s*,\s*(?:"
    + _VERSION.encode()
    + rb')?"(?:result|error)"\s*:'
)
#: a response whose result comes first and id last: {"result":...,"jsonrpc":"2.0","id":7}
_RESULT_FIRST = re.compile(rb"^\s*\{\s*(?:" + _VERSION.encode() + rb')?"(?:result|error)"\s*:')
_ID_LAST = re.compile(
    rb'"id"\s*:\s*' + _ID.encode() + rb'\s*(?:,\s*"jsonrpc"\s*:\s*"2\.0"\s*)?\}\s*$'
)


def answered_id(head: bytes, tail: bytes) -> int | str | None:
    """The id of the request an oversized message answers, if it is a response that says so at
    its start or its end (where JSON-RPC libraries put it); None otherwise. The server chooses
    what it sends either way: the worst a misleading one gets is an error for one of its own
    requests, which it could send outright."""
    found = _ID_FIRST.match(head)
    if found is None and _RESULT_FIRST.match(head):
        found = _ID_LAST.search(tail)
    if found is None:
        return None
    try:
        value = json.loads(found.group(1))
    except ValueError:
        return None
    return value if isinstance(value, int | str) else None


def oversized_error(
    request_id: int | str, total: int, limit: int, complete: bool
) -> SessionMessage:
    """The error that stands, for the session, in place of an answer over the limit."""
    error = mcp_types.ErrorData(
        code=OVERSIZED,
        message=oversized_reason(total, limit, complete),
        data={"bytes": total if complete else None, "limit": limit},
    )
    return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


# -- stdio --------------------------------------------------------------------------------------


@asynccontextmanager
async def stdio_client(
    server: StdioServerParameters, errlog: TextIO, max_message_bytes: int
) -> AsyncGenerator[TransportStreams, None]:
    """The SDK's stdio transport (``mcp.client.stdio.stdio_client``: the same spawn, the same
    shutdown, its own helpers), with the server's stdout read through a :class:`LineCutter`:
    a message over ``max_message_bytes`` is never held, and the request it answers gets an
    :data:`OVERSIZED` error instead."""
    command = await sdk_stdio._get_executable_command(server.command)
    process = await sdk_stdio._create_platform_compatible_process(
        command=command,
        args=server.args,
        env=get_default_environment() | (server.env or {}),
        errlog=errlog,
        cwd=server.cwd,
    )
    # As the SDK's: no awaits until the task group is entered, or a cancellation delivered in
    # the gap would leak the live process.
    read_stream_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](
        0
    )
    write_stream, write_stream_reader = anyio.create_memory_object_stream[SessionMessage](0)
    shutting_down = False
    writer_done = anyio.Event()

    def message(line: bytes | Oversized) -> SessionMessage | Exception | None:
        if isinstance(line, Oversized):
            request_id = answered_id(line.head, line.tail)
            log.warning(
                "MCP server message over the limit dropped",
                extra={"bytes": line.total, "limit": max_message_bytes, "id": request_id},
            )
            if request_id is None:
                return None
            return oversized_error(request_id, line.total, max_message_bytes, True)
        try:
            text = line.decode(server.encoding, errors=server.encoding_error_handler)
        except UnicodeDecodeError as exc:
            return exc
        return sdk_stdio._parse_line(text)

    async def stdout_reader() -> None:
        assert process.stdout, "Opened process is missing stdout"
        cutter = LineCutter(max_message_bytes)
        try:
            async with read_stream_writer:
                try:
                    while True:
                        try:
                            chunk = await process.stdout.receive(_CHUNK)
                        except anyio.EndOfStream:
                            break
                        for line in cutter.feed(chunk):
                            found = message(line)
                            if found is None:
                                continue
                            try:
                                await read_stream_writer.send(found)
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return  # the session is gone; only the drain below remains
                finally:
                    await sdk_stdio._drain_stdout(process)
        except anyio.ClosedResourceError:
            pass  # our own shutdown closed the stdout stream under the read
        except (anyio.BrokenResourceError, ConnectionError):
            if not shutting_down:
                log.exception("Reading from the MCP server's stdout failed mid-session")

    async def stdin_writer() -> None:
        assert process.stdin, "Opened process is missing stdin"
        try:
            async with write_stream_reader:
                async for session_message in write_stream_reader:
                    data = session_message.message.model_dump_json(
                        by_alias=True, exclude_unset=True
                    )
                    await process.stdin.send(
                        (data + "\n").encode(server.encoding, server.encoding_error_handler)
                    )
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_stream_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk_stdio._WRITER_FLUSH_TIMEOUT):
            await writer_done.wait()
        await sdk_stdio._stop_server_process(process)
        await sdk_stdio._aclose_all(
            read_stream, write_stream, read_stream_writer, write_stream_reader
        )
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            shutting_down = True
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
    await anyio.lowlevel.cancel_shielded_checkpoint()


# -- HTTP ---------------------------------------------------------------------------------------


#: a blank line, which ends an SSE event: two line ends (CRLF, CR or LF) in a row
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")


class _EventBounded(httpx2.AsyncByteStream):
    """An SSE stream passed on chunk by chunk while no event in it is over ``limit`` bytes;
    the chunk that takes one over is not handed on: the stream ends there with the SDK's own
    error for an oversized event (httpx2.SSEError), which closes the connection."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def __aiter__(self) -> AsyncGenerator[bytes]:
        size, carry = 0, b""
        async for chunk in self.inner:
            # (the last bytes of the chunk before: a blank line may straddle two chunks)
            window = carry + chunk
            end = None
            for found in _BLANK_LINE.finditer(window):
                end = found.end()
            size = size + len(chunk) if end is None else len(window) - end
            if size > self.limit:
                raise httpx2.SSEError(f"Server-sent event exceeded the {self.limit} byte limit.")
            carry = window[-3:]
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class BoundedTransport(httpx2.AsyncBaseTransport):
    """An HTTP transport that reads a JSON answer to a request up to ``limit`` bytes: a longer
    one (or one whose Content-Length says so) is not read on, its connection is closed, and the
    request gets an :data:`OVERSIZED` JSON-RPC error as its answer. An SSE stream is cut at its
    first event over the limit when ``events`` (the SSE transport, whose SDK client takes no
    limit; over streamable HTTP the SDK bounds the events itself). Other answers (an empty
    202) pass as they come."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int, events: bool = False) -> None:
        self.inner = inner
        self.limit = limit
        self.events = events

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        kind = response.headers.get("content-type", "").lower()
        if self.events and kind.startswith("text/event-stream"):
            stream = response.stream
            assert isinstance(stream, httpx2.AsyncByteStream)
            response.stream = _EventBounded(stream, self.limit)
            return response
        if not kind.startswith("application/json"):
            return response
        declared = _int(response.headers.get("content-length"))
        body = bytearray()
        over = declared is not None and declared > self.limit
        try:
            if not over:
                # decoded as it comes (a compressed chunk is a bounded ratio of its size)
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > self.limit:
                        over = True
                        break
        finally:
            await response.aclose()
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
        if not over:
            return httpx2.Response(
                response.status_code, headers=headers, content=bytes(body), request=request
            )
        request_id = _request_id(request)
        log.warning(
            "MCP server answer over the limit dropped",
            extra={"bytes": declared, "limit": self.limit, "id": request_id},
        )
        if request_id is None:
            body_text = b"{}"
        else:
            complete = declared is not None
            error = oversized_error(request_id, declared or len(body), self.limit, complete)
            body_text = error.message.model_dump_json(by_alias=True).encode()
        return httpx2.Response(
            200,
            headers=[(k, v) for k, v in headers if k.lower() != "content-type"]
            + [("content-type", "application/json")],
            content=body_text,
            request=request,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


#: headers that describe the body as it came, not as it is handed on.
_FRAMING = {"content-length", "transfer-encoding", "content-encoding"}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _request_id(request: httpx2.Request) -> int | str | None:
    """The JSON-RPC id of a request Charlie sent (its own body, already in memory)."""
    try:
        sent: Any = json.loads(request.content or b"null")
    except (ValueError, httpx2.RequestNotRead):
        return None
    found = sent.get("id") if isinstance(sent, dict) else None
    return found if isinstance(found, int | str) else None
