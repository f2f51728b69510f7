"""Connections to MCP servers: one background event loop per process, one session per server.

Tool handlers are synchronous and run in a worker's pool; the MCP SDK is asynchronous and its
sessions are long-lived. So each process has one daemon thread running an asyncio loop, made
on first use and made again in a forked child (a fork copies no threads: a child that finds
another process's loop starts its own, and ``reset_after_fork`` drops the parent's). The loop
holds one session per server, each entered and exited in a task of its own (anyio's cancel
scopes must be exited by the task that entered them): a stdio server is started on first use in
this process and reused; an HTTP server gets one session whose HTTP client pools connections.
Handlers call into the loop with ``run_coroutine_threadsafe`` and wait for the answer with a
timeout, and stop waiting when their call's lease is lost.

What a failure means decides recovery, so it is classified here (I10):

- :class:`Unavailable`: no session could be made (the server did not start, refused the
  connection, did not answer in time): the request was never sent.
- :class:`Lost`: the request went out and no answer came (the server's connection closed, its
  process died, the call timed out, the answer was unreadable): whether it acted is unknown.
- :class:`Refused`: the server answered with a JSON-RPC error: it did not run the request.
- :class:`TooLarge`: the server answered with more than one message may hold
  (CHARLIE_MCP_MAX_MESSAGE_BYTES): the answer was dropped unread (charlie.mcp.bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, ClassVar, Literal, TextIO, TypeVar

import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client import ClaimContext, ClientExtension, ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel

from charlie.mcp import bounded
from charlie.mcp.config import McpConfig, ServerConfig

log = logging.getLogger("charlie.mcp")

# httpx logs every request's URL at INFO, and a URL may carry a credential in its query.
for _noisy in ("httpx2", "httpcore2", "httpx", "httpcore"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)

T = TypeVar("T")

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
#: the most of one message from a server that is read (CHARLIE_MCP_MAX_MESSAGE_BYTES): more
#: than the result cap (CHARLIE_MAX_RESULT_BYTES), which cuts what is kept of a result.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class McpFailure(Exception):
    def __init__(self, server: str, reason: str) -> None:
        super().__init__(reason)
        self.server = server
        self.reason = reason


class Unavailable(McpFailure):
    """No session: the request was never sent."""


class Lost(McpFailure):
    """The request was sent and no answer came: what the server did is unknown."""


class Refused(McpFailure):
    """The server answered with an error: it did not run the request."""

    def __init__(self, server: str, code: int, message: str) -> None:
        super().__init__(server, message)
        self.code = code


class TooLarge(McpFailure):
    """The server answered with more than Charlie reads of one message: the answer was
    dropped unread (charlie.mcp.bounded), so the request was acted on, and its result is
    not known."""


class Abandoned(Exception):
    """The caller stopped waiting (its call's lease was lost): nothing is known."""


class CreatedTask(mcp_types.Result):
    """A ``tools/call`` answered with a task (the tasks extension, SEP-2663): the work goes on
    at the server under ``task_id``, polled with ``tasks/get``."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    result_type: Literal["task"] = "task"
    task_id: str
    status: str = "working"
    status_message: str | None = None
    poll_interval_ms: int | None = None


async def _never_resolved(result: CreatedTask, ctx: ClaimContext) -> mcp_types.CallToolResult:
    # Charlie follows a task itself, durably (charlie.mcp.tools); the SDK's own resolution
    # (poll in-process until done) would hold a worker and die with it.
    raise RuntimeError("Charlie follows MCP tasks itself")


class TasksExtension(ClientExtension):
    """Declares the tasks extension, so a server may answer a call with a task."""

    identifier = TASKS_EXTENSION

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=_never_resolved)]


class _TaskParams(mcp_types.RequestParams):
    task_id: str
    input_responses: dict[str, Any] | None = None


class _TaskRequest(mcp_types.Request[_TaskParams, str]):
    #: SEP-2663: tasks/* carry the task id in the Mcp-Name header, for routing.
    name_param: ClassVar[str | None] = "taskId"


_RAW = TypeAdapter(dict[str, Any])

Outcome = mcp_types.CallToolResult | mcp_types.InputRequiredResult | CreatedTask


def _chain(exc: BaseException) -> list[BaseException]:
    """Every exception in ``exc``: its groups' members, causes and contexts."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)
    return seen


def _never_connected(exc: BaseException | None) -> bool:
    """Whether the transport failed to connect at all (nothing was sent on it then)."""
    if exc is None:
        return False
    return any(
        type(e).__name__ in ("ConnectError", "ConnectTimeout")
        or isinstance(e, ConnectionRefusedError)
        for e in _chain(exc)
    )


def describe(exc: BaseException) -> str:
    """One line about a failure: the first exception in it that says something (a group's
    members and the causes behind it searched, flow-control exceptions skipped)."""
    fallback = None
    for e in _chain(exc):
        if isinstance(e, BaseExceptionGroup | asyncio.CancelledError | GeneratorExit):
            continue
        lines = str(e).strip().splitlines()
        if lines and lines[0]:
            return f"{type(e).__name__}: {lines[0]}"
        fallback = fallback or type(e).__name__
    return fallback or type(exc).__name__


def _scrubbed_stderr(server: ServerConfig, stack: AsyncExitStack) -> TextIO:
    """A stdio server's stderr: a pipe whose lines a thread writes on to this process's own
    (fd 2, where the server's would have gone: a worker's log) with the configuration's
    secrets blanked, so a server that logs its token does not put it in Charlie's logs,
    and each line cut to a bounded length as it is read (bounded.forward_stderr).
    The pipe's write end is the server's alone once the session ends (the reader then sees
    the end of the pipe when the server exits)."""
    read_fd, write_fd = os.pipe()  # (not inherited by any other child: O_CLOEXEC)
    writer = os.fdopen(write_fd, "w")
    stack.callback(writer.close)
    config = McpConfig(servers=(server,))
    longest = max((len(s.encode()) for s in server.secrets()), default=0)
    threading.Thread(
        target=bounded.forward_stderr, args=(read_fd, config.scrub, longest),
        name=f"charlie-mcp-stderr-{server.name}", daemon=True,
    ).start()  # fmt: skip
    return writer


async def _listing(client: Client) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(100):
        page = await client.session.list_tools(
            params=mcp_types.PaginatedRequestParams(cursor=cursor)
        )
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _bounded_listing(seconds: float) -> Callable[[Client], Awaitable[list[mcp_types.Tool]]]:
    async def listing(client: Client) -> list[mcp_types.Tool]:
        return await asyncio.wait_for(_listing(client), seconds)

    return listing


class _Link:
    """One server's session in this process's loop, made again when it ends."""

    def __init__(self, server: ServerConfig, timeout: float, max_message_bytes: int) -> None:
        self.server = server
        self.timeout = server.timeout or timeout
        self.max_message_bytes = max_message_bytes
        self.client: Client | None = None
        self.ended_by: BaseException | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None

    def _alive(self) -> bool:
        if self.client is None or self._holder is None or self._holder.done():
            return False
        # The SDK marks a session whose transport ended (a stdio server that exited) closed;
        # the attribute is not public, so a missing one reads as alive and the call finds out.
        dispatcher = getattr(self.client.session, "_dispatcher", None)
        return not bool(getattr(dispatcher, "_closed", False))

    async def session(self) -> Client:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._alive():
                assert self.client is not None
                return self.client
            await self._drop()
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[Client] = loop.create_future()
            ready.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._stop = asyncio.Event()
            self.ended_by = None
            self._holder = loop.create_task(self._hold(ready, self._stop))
            try:
                async with asyncio.timeout(self.timeout):
                    self.client = await asyncio.shield(ready)
            except TimeoutError:
                await self._drop()
                raise Unavailable(
                    self.server.name, f"it did not answer within {self.timeout:g} s"
                ) from None
            except Unavailable:
                await self._drop()
                raise
            return self.client

    async def _hold(self, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Enter the session, hand it out, and hold it until told to stop or until its
        transport ends; record why it ended."""
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(self._client(stack))
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we were asked to stop
            self.ended_by = exc
        except Exception as exc:
            self.ended_by = exc
        finally:
            if not ready.done():
                reason = describe(self.ended_by) if self.ended_by else "it closed at once"
                ready.set_exception(Unavailable(self.server.name, reason))
            self.client = None

    def _client(self, stack: AsyncExitStack) -> Client:
        s = self.server
        if s.transport == "stdio":
            assert s.command is not None
            params = StdioServerParameters(
                command=s.command, args=list(s.args), env=dict(s.env) or None, cwd=s.cwd
            )
            transport = bounded.stdio_client(
                params, _scrubbed_stderr(s, stack), self.max_message_bytes
            )
            return Client(transport, extensions=[TasksExtension()])
        import httpx2

        if s.transport == "sse":
            # (an agent's server, charlie.agents.mcp: the configuration file names none)
            return self._sse_client()
        http = httpx2.AsyncClient(
            headers=dict(s.headers) or None,
            timeout=httpx2.Timeout(30.0, connect=self.timeout, read=None),
            # a JSON answer is read up to the limit, and no further (an SSE event is bounded
            # by the SDK, given the same limit below)
            transport=bounded.BoundedTransport(httpx2.AsyncHTTPTransport(), self.max_message_bytes),
        )
        stack.push_async_callback(http.aclose)
        assert s.url is not None
        return Client(
            streamable_http_client(
                s.url, http_client=http, max_sse_event_size=self.max_message_bytes
            ),
            extensions=[TasksExtension()],
        )

    def _sse_client(self) -> Client:
        """A server over the SSE transport: its GET stream carries the answers, each POST a
        request; a JSON answer is read up to the limit as over streamable HTTP, and the event
        stream is cut at its first event over the limit (the SDK's SSE client takes no limit
        of its own: it holds an event up to its fixed 1 MiB), which ends the session: the
        request it answered is TooLarge (I15)."""
        import httpx2
        from mcp.client.sse import sse_client

        s, limit = self.server, self.max_message_bytes

        def factory(
            headers: dict[str, str] | None = None,
            timeout: httpx2.Timeout | None = None,
            auth: httpx2.Auth | None = None,
        ) -> httpx2.AsyncClient:
            return httpx2.AsyncClient(
                headers=headers,
                timeout=timeout or httpx2.Timeout(30.0, connect=self.timeout, read=None),
                auth=auth,
                follow_redirects=True,
                transport=bounded.BoundedTransport(httpx2.AsyncHTTPTransport(), limit, events=True),
            )

        assert s.url is not None
        return Client(
            sse_client(
                s.url,
                headers=dict(s.headers) or None,
                timeout=self.timeout,
                sse_read_timeout=24 * 3600.0,
                httpx_client_factory=factory,
            ),
            extensions=[TasksExtension()],
        )

    async def _drop(self) -> None:
        """End the current session, if any: gracefully, then by cancelling it."""
        holder, stop = self._holder, self._stop
        self._holder = self._stop = None
        self.client = None
        if holder is None:
            return
        if stop is not None:
            stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(holder), 8.0)
        if not holder.done():
            holder.cancel()
            with contextlib.suppress(BaseException):
                await holder

    async def _ended(self) -> None:
        """Give a session whose call just failed a moment to record why it ended."""
        holder = self._holder
        if holder is not None and not holder.done() and not self._alive():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(holder), 1.0)

    async def run(self, call: Callable[[Client], Awaitable[T]], what: str) -> T:
        client = await self.session()
        try:
            return await call(client)
        except MCPError as exc:
            over = bounded.sse_over_limit(exc.message)
            if exc.code == mcp_types.CONNECTION_CLOSED and over is not None:
                # the answer came, as an SSE event over the limit (not read on)
                raise TooLarge(
                    self.server.name, bounded.oversized_reason(over + 1, over, complete=False)
                ) from None
            if exc.code == mcp_types.CONNECTION_CLOSED:
                await self._ended()
                ended = self.ended_by
                over = bounded.sse_over_limit(describe(ended)) if ended is not None else None
                if over is not None:
                    # the SSE transport's event stream ended at an event over the limit: the
                    # answer came, and was not read on (its session ended with it)
                    raise TooLarge(
                        self.server.name, bounded.oversized_reason(over + 1, over, complete=False)
                    ) from None
                if ended is not None and _never_connected(ended):
                    raise Unavailable(
                        self.server.name, f"it refused the connection ({describe(ended)})"
                    ) from None
                why = f" ({describe(self.ended_by)})" if self.ended_by else ""
                raise Lost(
                    self.server.name, f"its connection closed while {what} was in flight{why}"
                ) from None
            if exc.code == bounded.OVERSIZED:
                raise TooLarge(self.server.name, exc.message) from None
            if exc.code == mcp_types.REQUEST_TIMEOUT:
                raise Lost(self.server.name, f"it did not answer {what} in time") from None
            raise Refused(self.server.name, exc.code, exc.message) from None
        except ValidationError as exc:
            raise Lost(
                self.server.name,
                f"its answer to {what} was not a valid result ({exc.error_count()} errors)",
            ) from None
        except (OSError, EOFError) as exc:
            raise Lost(self.server.name, f"{what} failed in flight ({describe(exc)})") from None

    async def close(self) -> None:
        await self._drop()


class Connections:
    """This process's MCP sessions, in their background loop."""

    def __init__(
        self, config: McpConfig, timeout: float, max_message_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.pid = os.getpid()
        self._links = {s.name: _Link(s, timeout, max_message_bytes) for s in config.servers}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._start:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=serve, name="charlie-mcp", daemon=True)
                self._thread.start()
                started.wait(10)
                self._loop = loop
            return self._loop

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        async def run() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop())

    def wait(
        self, future: concurrent.futures.Future[T], timeout: float, stop: threading.Event | None
    ) -> T:
        """The future's result within ``timeout`` seconds; checked every quarter second for
        ``stop`` (the caller's lease lost), which abandons the wait."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(0.25, left)))
            except concurrent.futures.TimeoutError:
                if stop is not None and stop.is_set():
                    future.cancel()
                    raise Abandoned() from None
                if left <= 0:
                    future.cancel()
                    raise
            except concurrent.futures.CancelledError:
                raise Abandoned() from None

    def _link(self, server: str) -> _Link:
        link = self._links.get(server)
        if link is None:
            raise Unavailable(server, "no MCP server of that name is configured here")
        return link

    def _run(
        self,
        server: str,
        call: Callable[[Client], Awaitable[T]],
        what: str,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> T:
        link = self._link(server)
        # The session's own timeout answers first (Lost); this one only guards the thread.
        future = self.submit(link.run(call, what))
        try:
            return self.wait(future, timeout + link.timeout + 5.0, stop)
        except concurrent.futures.TimeoutError:
            raise Lost(server, f"it did not answer {what} in time") from None

    def list_tools(self, server: str, timeout: float | None = None) -> list[mcp_types.Tool]:
        """Every tool the server lists (all pages)."""
        limit = timeout or self._link(server).timeout
        return self._run(server, _bounded_listing(limit), "tools/list", limit)

    def list_many(
        self, names: list[str], timeout: float | None = None
    ) -> dict[str, list[mcp_types.Tool] | McpFailure]:
        """List the tools of several servers at once, each within its own timeout."""
        futures: dict[str, concurrent.futures.Future[list[mcp_types.Tool]]] = {}
        for name in names:
            link = self._link(name)
            futures[name] = self.submit(link.run(_bounded_listing(link.timeout), "tools/list"))
        found: dict[str, list[mcp_types.Tool] | McpFailure] = {}
        end = time.monotonic() + (timeout or max(k.timeout for k in self._links.values())) + 5.0
        for name, future in futures.items():
            try:
                found[name] = future.result(timeout=max(0.1, end - time.monotonic()))
            except McpFailure as failure:
                found[name] = failure
            except concurrent.futures.TimeoutError:
                future.cancel()
                found[name] = Unavailable(name, "it did not list its tools in time")
            except Exception as exc:
                found[name] = Unavailable(name, describe(exc))
        return found

    def call_tool(
        self,
        server: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        timeout: float,
        input_responses: dict[str, Any] | None = None,
        request_state: str | None = None,
        stop: threading.Event | None = None,
    ) -> Outcome:
        async def calling(client: Client) -> Outcome:
            result = await client.session.call_tool(
                tool,
                arguments,
                read_timeout_seconds=timeout,
                input_responses=input_responses,
                request_state=request_state,
                allow_input_required=True,
                allow_claimed=True,
            )
            if isinstance(result, mcp_types.CallToolResult | mcp_types.InputRequiredResult):
                return result
            if isinstance(result, CreatedTask):
                return result
            raise Lost(server, f"it answered tools/call with {type(result).__name__}")

        return self._run(server, calling, f"tools/call {tool}", timeout, stop)

    def request(
        self,
        server: str,
        method: str,
        task_id: str,
        *,
        timeout: float,
        input_responses: dict[str, Any] | None = None,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """One request of the tasks extension (tasks/get, tasks/update, tasks/cancel): the
        server's answer as it came."""
        request = _TaskRequest(
            method=method, params=_TaskParams(task_id=task_id, input_responses=input_responses)
        )

        async def send(client: Client) -> dict[str, Any]:
            answer: dict[str, Any] = await client.session.send_request(
                request,
                _RAW,  # type: ignore[type-var]  # a raw answer: the extension's shapes vary
                request_read_timeout_seconds=timeout,
            )
            return answer

        return self._run(server, send, method, timeout, stop)

    def close(self) -> None:
        """End every session and the loop (a producer's one-off discovery, a test)."""
        loop = self._loop
        if loop is None or os.getpid() != self.pid:
            return

        async def closing() -> None:
            await asyncio.gather(*(link.close() for link in self._links.values()))

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(closing(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None


#: this process's connections, per configuration (a process has one; tests have several).
_current: dict[str, Connections] = {}
_lock = threading.Lock()


def connections(
    config: McpConfig, timeout: float, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> Connections:
    """This process's connections for ``config`` (made again in a forked child: a fork copies
    no thread, so a parent's loop and sessions are not the child's)."""
    key = f"{config.fingerprint()}:{max_message_bytes}"
    with _lock:
        found = _current.get(key)
        if found is None or found.pid != os.getpid():
            found = _current[key] = Connections(config, timeout, max_message_bytes)
        return found


def close_all() -> None:
    """End this process's sessions (their servers stop; a later call connects again)."""
    with _lock:
        mine = [c for c in _current.values() if c.pid == os.getpid()]
        _current.clear()
    for found in mine:
        found.close()


def reset_after_fork() -> None:
    """A forked child uses none of its parent's sessions (their loop thread did not fork)."""
    with _lock:
        _current.clear()
