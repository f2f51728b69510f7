"""An MCP server for the tests, built with the official SDK (MCPServer), over stdio, streamable
HTTP or SSE: ``python tests/support/mcp_server.py [--http PORT [--sse]] [--name NAME]``.

Every execution of a tool is written to a ledger outside Charlie (``MCP_TEST_LEDGER``), so a
test counts what really ran, whatever Charlie's records say. A stdio server reads its token
from ``MCP_TEST_TOKEN`` (its config's ``env``); an HTTP server refuses any request without
``Authorization: Bearer $MCP_TEST_TOKEN`` (its config's ``headers``).

Tools: ``lookup`` (read-only), ``delete_record`` (destructive; ``hold`` keeps it running after
its ledger entry), ``fails`` (a tool error), ``leak`` (answers with the token, and over stdio
writes it to stderr, to show Charlie blanks it), ``confirm_delete`` (asks for input:
``input_required``), ``unhinted`` (no annotations), ``flood`` (gigabytes on stderr, and an
answer of gigabytes), and, through the tasks extension
(SEP-2663, served here since the SDK has no server side for it): ``slow_job`` (answered
with a task, polled by ``tasks/get``) and ``approve_job`` (a task that needs input, answered
with ``tasks/update``).

Imports only the SDK and the standard library: a stdio server gets a bare environment.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, Extension, MCPServer, MethodBinding
from mcp_types import (
    ElicitRequest,
    ElicitRequestFormParams,
    InputRequiredResult,
    RequestParams,
    ToolAnnotations,
)

NAME = os.environ.get("MCP_TEST_NAME", "testsrv")
TOKEN = os.environ.get("MCP_TEST_TOKEN", "")
TASKS = "io.modelcontextprotocol/tasks"
TASK_TOOLS = ("slow_job", "approve_job")
#: served over stdio (not --http): what it writes to stderr goes to its client's log.
STDIO = "--http" not in sys.argv


def record(event: str, **fields: Any) -> None:
    path = os.environ.get("MCP_TEST_LEDGER")
    if not path:
        return
    line = {
        "event": event, "server": NAME, "pid": os.getpid(), "ppid": os.getppid(),
        "t": time.time(), **fields,
    }  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def now() -> str:
    return datetime.now(UTC).isoformat()


class TaskParams(RequestParams):
    task_id: str


class UpdateParams(RequestParams):
    task_id: str
    input_responses: dict[str, Any] = {}


class TaskStore:
    """Tasks as files in ``MCP_TEST_TASKS_DIR`` (an outside job system's records): any process
    of this server reads and updates them, so a stdio server started by another worker process
    follows a task too; the job itself runs in the process that created it."""

    def __init__(self, root: str | None) -> None:
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="mcp-tasks-"))
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, task_id: str, suffix: str = ".json") -> Path:
        if not task_id.replace("-", "").isalnum():
            raise KeyError(task_id)
        return self.root / f"{task_id}{suffix}"

    def get(self, task_id: str) -> dict[str, Any] | None:
        try:
            loaded: dict[str, Any] = json.loads(self._path(task_id).read_text())
        except (OSError, KeyError, ValueError):
            return None
        return loaded

    def put(self, task: dict[str, Any]) -> None:
        path = self._path(task["taskId"])
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(task))
        tmp.replace(path)

    def answer(self, task_id: str, key: str, response: dict[str, Any]) -> None:
        self._path(task_id, f".answer-{hashlib.sha256(key.encode()).hexdigest()[:12]}").write_text(
            json.dumps(response)
        )

    def answered(self, task_id: str, key: str) -> dict[str, Any] | None:
        path = self._path(task_id, f".answer-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
        try:
            loaded: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return loaded


class Tasks(Extension):
    """The tasks extension's server side (SEP-2663: tasks/get, tasks/update, tasks/cancel)."""

    identifier = TASKS

    def __init__(self) -> None:
        self.store = TaskStore(os.environ.get("MCP_TEST_TASKS_DIR"))
        self.running: set[asyncio.Task[None]] = set()

    def methods(self) -> list[MethodBinding]:
        return [
            MethodBinding("tasks/get", TaskParams, self.get),
            MethodBinding("tasks/update", UpdateParams, self.update),
            MethodBinding("tasks/cancel", TaskParams, self.cancel),
        ]

    def _known(self, task_id: str) -> dict[str, Any]:
        from mcp.shared.exceptions import MCPError
        from mcp_types import INVALID_PARAMS

        task = self.store.get(task_id)
        if task is None:
            raise MCPError(INVALID_PARAMS, f"Failed to retrieve task: no task {task_id}")
        return task

    async def get(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        task = self._known(params.task_id)
        record("tasks/get", task_id=params.task_id, status=task["status"])
        return {"resultType": "complete", **task}

    async def update(self, ctx: Any, params: UpdateParams) -> dict[str, Any]:
        task = self._known(params.task_id)
        record("tasks/update", task_id=params.task_id, keys=sorted(params.input_responses))
        for key, response in params.input_responses.items():
            if key in task.get("inputRequests", {}):
                self.store.answer(params.task_id, key, response)
        return {"resultType": "complete"}

    async def cancel(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        task = self._known(params.task_id)
        record("tasks/cancel", task_id=params.task_id)
        if task["status"] not in ("completed", "failed", "cancelled"):
            self._set(params.task_id, "cancelled", statusMessage="cancelled by the client")
        return {"resultType": "complete"}

    def _set(self, task_id: str, status: str, **fields: Any) -> dict[str, Any]:
        task = self.store.get(task_id) or {"taskId": task_id}
        task.update(status=status, lastUpdatedAt=now(), **fields)
        if status != "input_required":
            task.pop("inputRequests", None)
        self.store.put(task)
        return task

    def _cancelled(self, task_id: str) -> bool:
        return (self.store.get(task_id) or {}).get("status") == "cancelled"

    async def intercept_tool_call(self, params: Any, ctx: Any, call_next: Any) -> Any:
        if params.name not in TASK_TOOLS:
            return await call_next(ctx)
        from mcp.server.mcpserver import require_client_extension

        require_client_extension(ctx, TASKS)
        task_id = f"task-{uuid.uuid4().hex}"
        task = {
            "taskId": task_id,
            "status": "working",
            "createdAt": now(),
            "lastUpdatedAt": now(),
            "ttlMs": None,
            "pollIntervalMs": 300,
        }
        self.store.put(task)
        arguments = dict(params.arguments or {})
        record(f"{params.name}.created", task_id=task_id, **arguments)
        work = self._slow_job if params.name == "slow_job" else self._approve_job
        job = asyncio.get_running_loop().create_task(work(task_id, arguments))
        self.running.add(job)
        job.add_done_callback(self.running.discard)
        return {"resultType": "task", **task}

    def _done(self, task_id: str, text: str) -> None:
        if self._cancelled(task_id):
            return
        result = {"content": [{"type": "text", "text": text}], "isError": False}
        self._set(task_id, "completed", result=result)

    async def _slow_job(self, task_id: str, arguments: dict[str, Any]) -> None:
        key = arguments.get("key", "")
        record("slow_job.start", task_id=task_id, key=key)
        end = time.monotonic() + float(arguments.get("seconds", 1))
        while time.monotonic() < end:
            if self._cancelled(task_id):
                record("slow_job.cancelled", task_id=task_id, key=key)
                return
            await asyncio.sleep(0.05)
        record("slow_job.end", task_id=task_id, key=key)
        self._done(task_id, f"job {key} done")

    async def _approve_job(self, task_id: str, arguments: dict[str, Any]) -> None:
        key = arguments.get("key", "")
        ask = f"approve-{key}"
        request = {
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": f"Approve job {key}?",
                "requestedSchema": {
                    "type": "object",
                    "properties": {"approve": {"type": "boolean"}},
                    "required": ["approve"],
                },
            },
        }
        self._set(task_id, "input_required", inputRequests={ask: request})
        while (answer := self.store.answered(task_id, ask)) is None:
            if self._cancelled(task_id):
                return
            await asyncio.sleep(0.05)
        self._set(task_id, "working")
        approved = bool((answer.get("content") or {}).get("approve"))
        record("approve_job.answered", task_id=task_id, key=key, approved=approved)
        await asyncio.sleep(float(arguments.get("seconds", 0.2)))
        self._done(task_id, f"job {key} {'approved' if approved else 'refused'}")


def connection_of(ctx: Context) -> dict[str, Any]:
    """Over HTTP, which connection (the client's port) a request came on: how a test sees
    its client pool them."""
    client = getattr(ctx.request_context.request, "client", None)
    return {} if client is None else {"peer_port": client.port}


tasks = Tasks()
server = MCPServer(NAME, extensions=[tasks], log_level="WARNING")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup(key: str, ctx: Context, hold: float = 0.0) -> str:
    """Look a key up in the test store."""
    record("lookup", key=key, **connection_of(ctx))
    time.sleep(hold)
    return f"{key}=v-{key}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def delete_record(key: str, hold: float = 0.0) -> str:
    """Delete a record (destructive)."""
    record("delete.start", key=key)
    time.sleep(hold)
    record("delete.end", key=key)
    return f"deleted {key}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def fails(message: str) -> str:
    """Always fails."""
    raise ValueError(message)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def leak() -> str:
    """Answer with the server's token (a server that leaks a secret)."""
    if STDIO:
        # and log it, as a careless server does: a stdio server's stderr is its client's
        print(f"leak: the token is {TOKEN}", file=sys.stderr, flush=True)
    return f"the token is {TOKEN}"


@server.tool()
def unhinted(key: str) -> str:
    """A tool whose server says nothing about its effect."""
    record("unhinted", key=key)
    return f"unhinted {key}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def confirm_delete(key: str, ctx: Context, hold: float = 0.0) -> str | InputRequiredResult:
    """Delete a record once a person confirms it."""
    responses = ctx.input_responses or {}
    answer = responses.get("confirm")
    if answer is None:
        record("confirm_delete.asked", key=key)
        schema = {
            "type": "object",
            "properties": {"confirm": {"type": "boolean", "title": "Delete it?"}},
            "required": ["confirm"],
        }
        return InputRequiredResult(
            input_requests={
                "confirm": ElicitRequest(
                    params=ElicitRequestFormParams(
                        message=f"Really delete {key}?", requested_schema=schema
                    )
                )
            },
            request_state=f"asked:{key}",
        )
    state = ctx.request_state
    if state is not None and state != f"asked:{key}":
        raise ValueError(f"request state for another key: {state}")
    confirmed = bool((getattr(answer, "content", None) or {}).get("confirm"))
    if getattr(answer, "action", "accept") != "accept" or not confirmed:
        record("confirm_delete.kept", key=key, state=state is not None)
        return f"kept {key}"
    record("confirm_delete.deleted", key=key, state=state is not None)
    time.sleep(hold)
    return f"deleted {key}"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def slow_job(key: str, seconds: float = 1.0) -> str:
    """Run a job that takes a while (answered with a task)."""
    return "not reached: the tasks extension answers with a task"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
def approve_job(key: str, seconds: float = 0.2) -> str:
    """Run a job that needs a person's approval on the way (a task that asks for input)."""
    return "not reached: the tasks extension answers with a task"


#: where Charlie cuts a line of a stdio server's stderr (charlie.mcp.bounded.STDERR_LINE_BYTES)
STDERR_CUT = 8 * 1024


def _stream(fd: int, head: bytes, size: int, tail: bytes) -> None:
    """Write ``head``, ``size`` bytes of filler and ``tail`` to ``fd``, a MiB at a time: the
    flood never sits in this process's memory."""
    block = b"x" * (1024 * 1024)
    for data in (head, *([block] * (size // len(block))), block[: size % len(block)], tail):
        while data:
            data = data[os.write(fd, data) :]


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def flood(
    ctx: Context,
    stderr_bytes: int = 0,
    result_bytes: int = 0,
    id_last: bool = False,
    declare_length: bool = False,
    answer_bytes: int = 0,
    as_sse: bool = False,
) -> str:
    """A server that writes without end: a stderr line of ``stderr_bytes`` (the token astride
    where Charlie cuts such a line), and an answer of ``result_bytes``: over stdio written raw,
    its id first (as this SDK writes it) or last (``id_last``, as others do), the SDK's own
    answer that follows coming late and dropped; over HTTP a JSON body streamed raw by the
    app in front of the server (``declare_length``: with a Content-Length; ``as_sse``: as one
    SSE event); ``answer_bytes``:
    an answer of that size the SDK sends itself (over HTTP, as an SSE event)."""
    record("flood", stderr_bytes=stderr_bytes, result_bytes=result_bytes)
    if stderr_bytes:
        start = b"e" * (STDERR_CUT - 16) + TOKEN.encode()
        _stream(2, start, max(0, stderr_bytes - len(start)), b"\n")
    if result_bytes and STDIO:
        request_id = json.dumps(ctx.request_context.request_id).encode()
        text = b'{"content":[{"type":"text","text":"'
        if id_last:
            head = b'{"result":' + text
            tail = b'"}],"isError":false,"resultType":"complete"},"jsonrpc":"2.0","id":'
            tail += request_id + b"}\n"
        else:
            head = b'{"jsonrpc":"2.0","id":' + request_id + b',"result":' + text
            tail = b'"}],"isError":false,"resultType":"complete"}}\n'
        _stream(_wire(), head, result_bytes, tail)
    return "a" * answer_bytes if answer_bytes else "flooded"


def _wire() -> int:
    """The descriptor this stdio server's messages go out on: the SDK moves them off fd 1 (a
    tool's stray print goes to stderr instead), onto a duplicate only its transport knows."""
    from mcp.server import stdio

    claim = stdio._claims.get(1)
    return claim.private_fd if claim is not None and claim.private_fd is not None else 1


def http_app(port: int, sse: bool = False) -> Any:
    app = server.sse_app(host="127.0.0.1") if sse else server.streamable_http_app(host="127.0.0.1")
    expected = f"Bearer {TOKEN}".encode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and TOKEN:
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != expected:
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        if scope["type"] == "http" and scope["method"] == "POST":
            receive = await _flooding(receive, send)
            if receive is None:
                return
        await app(scope, receive, send)

    return guarded


async def _flooding(receive: Any, send: Any) -> Any:
    """Over HTTP, answer a ``flood`` call that asks for ``result_bytes`` here, with a JSON
    body of that size streamed raw (with its Content-Length, or chunked without one): None
    once answered. Any other request goes on to the server, its body read back to it."""
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        body += message.get("body", b"")
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    try:
        sent = json.loads(body)
    except ValueError:
        sent = None
    params = sent.get("params") or {} if isinstance(sent, dict) else {}
    arguments = params.get("arguments") or {}
    size = int(arguments.get("result_bytes") or 0)
    if sent.get("method") != "tools/call" or params.get("name") != "flood" or not size:

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        return replay
    record("flood", result_bytes=size, transport="http")
    head = b'{"jsonrpc":"2.0","id":' + json.dumps(sent["id"]).encode() + b',"result":'
    head += b'{"content":[{"type":"text","text":"'
    tail = b'"}],"structuredContent":{"result":"flooded"},"isError":false,'
    tail += b'"resultType":"complete"}}'
    headers = [(b"content-type", b"application/json")]
    if arguments.get("as_sse"):
        # the answer as one SSE event on the request's stream
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        head, tail = b"event: message\ndata: " + head, tail + b"\n\n"
    elif arguments.get("declare_length"):
        headers.append((b"content-length", str(len(head) + size + len(tail)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    block = b"x" * (1024 * 1024)
    await send({"type": "http.response.body", "body": head, "more_body": True})
    for _ in range(size // len(block)):
        await send({"type": "http.response.body", "body": block, "more_body": True})
    rest = block[: size % len(block)] + tail
    await send({"type": "http.response.body", "body": rest, "more_body": False})
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, help="serve streamable HTTP here")
    parser.add_argument("--sse", action="store_true", help="serve the SSE transport instead")
    args = parser.parse_args()
    down = os.environ.get("MCP_TEST_DOWN_FLAG")
    if down and os.path.exists(down):
        record("server.refused", transport="stdio")
        return  # a server that cannot start
    record("server.start", transport="http" if args.http else "stdio")
    if args.http is None:
        server.run()
        return
    import uvicorn

    app = http_app(args.http, sse=args.sse)
    uvicorn.run(app, host="127.0.0.1", port=args.http, log_level="warning")


if __name__ == "__main__":
    sys.exit(main())
