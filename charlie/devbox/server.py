"""The devbox HTTP server: JSON over HTTP so workers on other machines can reach it.

Routes (every one needs ``Authorization: Bearer <token or workspace credential>``)::

    PUT  /workspaces/{id}                  create or return a workspace (idempotent)
    GET  /workspaces/{id}                  describe it
    POST /workspaces/{id}/commands         start a command -> execution id, at once (an
                                           idempotency_key makes a repeated start return the
                                           first command's id)
    POST /workspaces/{id}/commands/lookup  the command started under an idempotency_key, never
                                           starting one; none: the key is sealed, so no start
                                           with it runs afterwards
    GET  /commands/{execution_id}?tail=N   status, exit code and output tails
    POST /commands/{execution_id}/cancel   kill its process group
    GET  /workspaces/{id}/files?path=      read a file
    PUT  /workspaces/{id}/files?path=      write a file
    GET  /workspaces/{id}/list?path=       list a directory
    POST /workspaces/{id}/patch            git apply a unified diff
    GET  /workspaces/{id}/diff             git diff HEAD plus untracked names
    POST /workspaces/{id}/commit           commit with an idempotency key
    GET  /workspaces/{id}/commits?idempotency_key=K   the commit carrying that key, if any
    GET  /health                           liveness

The operator token opens everything. A workspace's credential (charlie/devbox/credentials.py,
derived from the token) opens only ``/workspaces/{that id}/...``, the commands started in that
workspace and ``/health``; anything else is a 403. Workspaces are cloned or
copied only from the sources the operator allows (``RepoPolicy``, ``--allow-repo``; a 403
otherwise).

Errors are ``{"error": message}`` with the HTTP status saying what kind; a 500 says only
``request_id``, under which the devbox's log has the traceback.

Against slow or hostile clients (whoever can connect, before any token check): every socket
read and write times out (``Limits.http_idle_seconds``), a whole request must arrive within
``Limits.http_request_seconds``, at most ``Limits.http_connections`` are served at once, and a
body needs one plain Content-Length within ``Limits.request_bytes`` (413 unread otherwise). The
token is accepted only in the Authorization header; a token-named query parameter is a 400, and
log lines never carry the header, token-named values or the token itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, parse_qsl, unquote, urlsplit

from charlie.devbox.commands import CommandRunner, StartRequest
from charlie.devbox.confinement import workspace_policy
from charlie.devbox.credentials import Unauthorized, check_token, scope_of
from charlie.devbox.errors import ApiError
from charlie.devbox.paths import check_workspace_id, resolve_inside
from charlie.devbox.policy import (
    CommandPolicy,
    Limits,
    RepoPolicy,
    argv_command_names,
    command_env,
    is_secret_name,
    shell_command_names,
    validate_env,
)
from charlie.devbox.workspaces import Workspaces
from charlie.sandbox import SandboxPolicy, SandboxUnavailable, check_mode, network_stack

log = logging.getLogger(__name__)

JSONDict = dict[str, Any]
_DEFAULT_TAIL = 64 * 1024
_KEY = re.compile(r"\S{1,200}")


@dataclass(frozen=True)
class Request:
    method: str
    params: tuple[str, ...]
    query: dict[str, str]
    body: JSONDict


Handler = Callable[["Devbox", Request], JSONDict]


class Devbox:
    """The devbox's operations, independent of HTTP: one instance per root directory."""

    def __init__(
        self,
        root: Path,
        policy: CommandPolicy,
        limits: Limits,
        repos: RepoPolicy | None = None,
    ) -> None:
        self.root = root
        self.policy = policy
        self.limits = limits
        self.workspaces = Workspaces(root, limits, repos)
        self.commands = CommandRunner(root, limits.output_bytes, limits.workspace_bytes)

    # -- workspaces ----------------------------------------------------------------------------

    def put_workspace(self, req: Request) -> JSONDict:
        return self.workspaces.ensure(req.params[0], req.body)

    def get_workspace(self, req: Request) -> JSONDict:
        return self.workspaces.describe(req.params[0])

    # -- commands ------------------------------------------------------------------------------

    def start_command(self, req: Request) -> JSONDict:
        workspace_id = req.params[0]
        workspace = self.workspaces.path(workspace_id)
        argv, shell = _command(req.body)
        self.policy.check(
            shell_command_names(shell) if shell is not None else argv_command_names(argv)
        )
        cwd = resolve_inside(workspace, _opt_str(req.body, "cwd") or ".", allow_root=True)
        if not cwd.is_dir():
            raise ApiError(400, f"cwd {req.body.get('cwd')!r} is not a directory in the workspace")
        env = command_env(str(workspace), validate_env(req.body.get("env")))
        sandbox = self._sandbox(workspace, req.body.get("network"))
        raw_key = req.body.get("idempotency_key")
        key = None if raw_key is None else _key(raw_key)
        return self.commands.start(
            StartRequest(
                workspace_id=workspace_id,
                workspace_path=workspace,
                argv=argv if shell is None else ["/bin/sh", "-c", shell],
                shell=shell,
                cwd=cwd,
                env=env,
                timeout=self._timeout(req.body.get("timeout")),
                idempotency_key=key,
                sandbox=sandbox,
            )
        )

    def find_command(self, req: Request) -> JSONDict:
        workspace_id = check_workspace_id(req.params[0])
        return self.commands.find(workspace_id, _key(req.body.get("idempotency_key")))

    def _sandbox(self, workspace: Path, network: object) -> SandboxPolicy | None:
        """The command's sandbox: its workspace writable, the rest of the devbox root (other
        workspaces, commands' output) out of sight; or None where the operator opted out."""
        if network not in (None, True, False):
            raise ApiError(400, "network must be true or false")
        if network and not self.limits.allow_network:
            raise ApiError(
                403, "this devbox gives commands no network (start it with --allow-network)"
            )
        if self.limits.sandbox == "off":
            return None
        try:
            check_mode(self.limits.sandbox)
            if network:
                network_stack(self.limits.network_stack)
        except SandboxUnavailable as exc:
            raise ApiError(403, str(exc)) from None
        return workspace_policy(
            self.root,
            self.limits,
            workspace,
            network=bool(network),
            # A first line only: with the config read-only, planting a driver for the devbox's
            # git takes a race; what makes that race harmless is that git runs confined too.
            frozen=(workspace / ".git" / "config",),
        )

    def _timeout(self, raw: object) -> float:
        """The request may lower the devbox's command timeout, never raise it."""
        limit = self.limits.command_timeout
        if raw is None:
            return limit
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
            raise ApiError(400, f"timeout must be a positive number of seconds, not {raw!r}")
        return min(float(raw), limit)

    def command_status(self, req: Request) -> JSONDict:
        return self.commands.status(req.params[0], self._tail(req.query))

    def cancel_command(self, req: Request) -> JSONDict:
        return self.commands.cancel(req.params[0], self._tail(req.query))

    def _tail(self, query: dict[str, str]) -> int:
        raw = query.get("tail")
        if raw is None:
            return _DEFAULT_TAIL
        try:
            value = int(raw)
        except ValueError:
            raise ApiError(400, f"tail must be a whole number of bytes, not {raw!r}") from None
        if value < 0:
            raise ApiError(400, "tail must not be negative")
        return min(value, self.limits.output_bytes + 1024)

    # -- files and git -------------------------------------------------------------------------

    def read_file(self, req: Request) -> JSONDict:
        return self.workspaces.read_file(req.params[0], _query_path(req.query))

    def write_file(self, req: Request) -> JSONDict:
        content = req.body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, 'body must be {"content": string}')
        return self.workspaces.write_file(req.params[0], _query_path(req.query), content)

    def list_files(self, req: Request) -> JSONDict:
        return self.workspaces.list_files(req.params[0], req.query.get("path", "."))

    def apply_patch(self, req: Request) -> JSONDict:
        diff = req.body.get("diff")
        if not isinstance(diff, str):
            raise ApiError(400, 'body must be {"diff": unified diff string}')
        return self.workspaces.apply_patch(req.params[0], diff)

    def diff(self, req: Request) -> JSONDict:
        return self.workspaces.diff(req.params[0])

    def commit(self, req: Request) -> JSONDict:
        message = req.body.get("message")
        if not isinstance(message, str) or not message.strip():
            raise ApiError(400, "commit needs a non-empty 'message'")
        key = _key(req.body.get("idempotency_key"))
        return self.workspaces.commit(req.params[0], message, key)

    def find_commit(self, req: Request) -> JSONDict:
        return self.workspaces.find_commit(
            req.params[0],
            _key(req.query.get("idempotency_key")),
            seal=req.query.get("seal") in ("1", "true"),
        )

    def health(self, req: Request) -> JSONDict:
        return {"ok": True}

    def check_scope(self, scope: str | None, segments: list[str], params: tuple[str, ...]) -> None:
        """A workspace's credential reaches only that workspace and its commands (403)."""
        if scope is None or segments[0] == "health":
            return
        if segments[0] == "workspaces":
            target = params[0]
        elif segments[0] == "commands":
            target = self.commands.workspace_of(params[0])
        else:  # pragma: no cover - every route is one of the above
            target = None
        if target != scope:
            raise ApiError(
                403,
                f"this credential opens workspace {scope!r} only; it does not reach "
                f"{'/'.join(segments[:2])}",
            )


#: (method, path pattern, handler); ``{}`` matches one path segment passed in ``params``.
ROUTES: list[tuple[str, tuple[str, ...], Handler]] = [
    ("GET", ("health",), Devbox.health),
    ("PUT", ("workspaces", "{}"), Devbox.put_workspace),
    ("GET", ("workspaces", "{}"), Devbox.get_workspace),
    ("POST", ("workspaces", "{}", "commands"), Devbox.start_command),
    ("POST", ("workspaces", "{}", "commands", "lookup"), Devbox.find_command),
    ("GET", ("commands", "{}"), Devbox.command_status),
    ("POST", ("commands", "{}", "cancel"), Devbox.cancel_command),
    ("GET", ("workspaces", "{}", "files"), Devbox.read_file),
    ("PUT", ("workspaces", "{}", "files"), Devbox.write_file),
    ("GET", ("workspaces", "{}", "list"), Devbox.list_files),
    ("POST", ("workspaces", "{}", "patch"), Devbox.apply_patch),
    ("GET", ("workspaces", "{}", "diff"), Devbox.diff),
    ("POST", ("workspaces", "{}", "commit"), Devbox.commit),
    ("GET", ("workspaces", "{}", "commits"), Devbox.find_commit),
]


def route(method: str, segments: list[str]) -> tuple[Handler, tuple[str, ...]]:
    """The handler and its path parameters, or 404/405."""
    methods: set[str] = set()
    for route_method, pattern, handler in ROUTES:
        if len(pattern) != len(segments):
            continue
        if not all(p == "{}" or p == s for p, s in zip(pattern, segments, strict=True)):
            continue
        if route_method == method:
            params = tuple(s for p, s in zip(pattern, segments, strict=True) if p == "{}")
            return handler, params
        methods.add(route_method)
    if methods:
        raise ApiError(405, f"{method} not allowed here; use {', '.join(sorted(methods))}")
    raise ApiError(404, f"no such route: /{'/'.join(segments)}")


def _command(body: JSONDict) -> tuple[list[str], str | None]:
    argv, shell = body.get("argv"), body.get("shell")
    if (argv is None) == (shell is None):
        raise ApiError(400, "give exactly one of 'argv' (a list of strings) or 'shell' (a string)")
    if shell is not None:
        if not isinstance(shell, str) or not shell.strip() or "\x00" in shell:
            raise ApiError(400, "'shell' must be a non-empty string")
        return [], shell
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) and "\x00" not in a for a in argv)
        or not argv[0]
    ):
        raise ApiError(400, "'argv' must be a non-empty list of strings")
    return list(argv), None


def _opt_str(body: JSONDict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{key!r} must be a string")
    return value


def _query_path(query: dict[str, str]) -> str:
    path = query.get("path")
    if not path:
        raise ApiError(400, "give the file as ?path=<relative path>")
    return path


def _key(raw: object) -> str:
    if not isinstance(raw, str) or not _KEY.fullmatch(raw):
        raise ApiError(400, "idempotency_key must be 1-200 characters without whitespace")
    return raw


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # set after construction; typed here so the handler can reach them
    devbox: Devbox
    token: str
    #: one per connection being served; see process_request
    slots: threading.BoundedSemaphore
    #: set by stop(): a keep-alive connection accepted before is answered 503, not served on
    stopping: bool = False

    def process_request(self, request: Any, client_address: Any) -> None:
        # Past the cap a connection is answered 503 and closed at once: every served connection
        # holds a thread, and the token is only checked once its headers have arrived, so
        # without a cap anyone who can connect could exhaust the devbox's threads.
        if not self.slots.acquire(blocking=False):
            log.warning(
                "devbox: refused a connection from %s: %d connections already open",
                client_address[0],
                self.devbox.limits.http_connections,
            )
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(_TOO_MANY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver would print a traceback to stderr; a client that went away or was cut
        # off by a timeout is routine, anything else is a bug worth its traceback
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.info("devbox: connection from %s ended: %s", client_address[0], exc)
        else:
            log.exception("devbox: error serving a connection from %s", client_address[0])


_TOO_MANY_BODY = b'{"error": "the devbox has too many open connections; retry later"}'
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_TOO_MANY_BODY), _TOO_MANY_BODY)
)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive for httpx; every response has Content-Length
    # A response goes out as two writes (headers, body): with Nagle the body waits for the
    # client's delayed ACK of the headers, some 40 ms on every call of a kept-alive connection.
    disable_nagle_algorithm = True
    server_version = "CharlieDevbox/1"

    def setup(self) -> None:
        super().setup()
        # every read and write (the wait for the next request on a keep-alive connection
        # included) gives up after this, so a silent client frees its thread
        self.connection.settimeout(self.server.devbox.limits.http_idle_seconds)
        self._deadline_lock = threading.Lock()
        self._deadline: threading.Timer | None = None
        self._cut_off = False

    def handle_one_request(self) -> None:
        # the whole request must arrive within http_request_seconds: the idle timeout alone
        # restarts with every byte, so a client trickling its headers could hold on forever
        self._start_deadline()
        try:
            super().handle_one_request()
        finally:
            self._stop_deadline()

    def _start_deadline(self) -> None:
        timer = threading.Timer(self.server.devbox.limits.http_request_seconds, self._cut)
        timer.daemon = True
        with self._deadline_lock:
            self._deadline = timer
        timer.start()

    def _stop_deadline(self) -> None:
        """The request has been read: from here the handler may take as long as it needs."""
        with self._deadline_lock:
            timer, self._deadline = self._deadline, None
        if timer is not None:
            timer.cancel()

    def _cut(self) -> None:
        with self._deadline_lock:
            if self._deadline is None:
                return  # the request arrived just in time
            self._deadline = None
            self._cut_off = True
        log.info(
            "devbox: closed a connection from %s: no complete request within %gs",
            self.client_address[0],
            self.server.devbox.limits.http_request_seconds,
        )
        # unblocks the read in progress; the handler thread then finds the connection closed
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def do_GET(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        if self.server.stopping:
            self.close_connection = True
            self._send(503, {"error": "the devbox is stopping"})
            return
        try:
            status, payload = 200, self._dispatch()
        except ApiError as exc:
            status, payload = exc.status, {"error": exc.message}
        except Exception:  # the devbox must answer, not drop the connection
            # The caller gets an id to quote, never the exception: its text can hold paths,
            # file contents or git output from other workspaces. The log has it all.
            request_id = uuid.uuid4().hex[:16]
            log.exception(
                "devbox: request %s (%s %s) failed",
                request_id,
                self.command,
                _loggable_path(self.path),
            )
            status, payload = (
                500,
                {
                    "error": "internal devbox error; the devbox's log has the details under "
                    f"request id {request_id}",
                    "request_id": request_id,
                },
            )
        if self._cut_off:
            return  # the connection is closed; nothing can be sent
        self._send(status, payload)

    def _dispatch(self) -> JSONDict:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        # before the token check, so a right token in a URL is refused too: URLs end up in
        # logs, proxies and shell histories
        for name in query:
            if name.lower() in _TOKEN_PARAMS:
                self.close_connection = True
                raise ApiError(
                    400,
                    f"the devbox token does not go in the URL (query parameter {name!r}); "
                    "send it as the header Authorization: Bearer <token>",
                )
        scope = self._authorize()
        # the body is read before routing so an error answer leaves the connection clean
        try:
            body = self._body()
        except TimeoutError:  # a socket timeout, or the rest of the body never came
            self.close_connection = True
            raise ApiError(408, "the request body stopped arriving before its end") from None
        self._stop_deadline()
        if self._cut_off:
            raise ApiError(408, "the request took longer than the devbox allows to arrive")
        segments = [unquote(s) for s in url.path.strip("/").split("/") if s]
        handler, params = route(self.command, segments)
        self.server.devbox.check_scope(scope, segments, params)
        return handler(self.server.devbox, Request(self.command, params, query, body))

    def _authorize(self) -> str | None:
        """None for the operator token, the workspace id for a workspace's credential."""
        header = self.headers.get("Authorization", "")
        scheme, _, supplied = header.partition(" ")
        try:
            if scheme.lower() != "bearer":
                raise Unauthorized
            # compare_digest inside, so the time taken does not reveal how much matched
            return scope_of(self.server.token, supplied.strip())
        except Unauthorized:
            self.close_connection = True  # the body, if any, is not read
            raise ApiError(
                401, "missing or wrong devbox token (Authorization: Bearer <token>)"
            ) from None

    def _content_length(self) -> int:
        """The body's length from its one Content-Length header; 4xx (and the connection
        closed, since where the body ends is unknown) for anything else."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length, not chunked")
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            if self.command in ("POST", "PUT"):
                self.close_connection = True
                raise ApiError(411, f"{self.command} needs a Content-Length (0 for no body)")
            return 0
        raw = values.pop()
        # digits only: int() would also take "-1", "+5", " 5" and "1_0"
        if values or not _DIGITS.fullmatch(raw):
            self.close_connection = True
            raise ApiError(400, "invalid Content-Length: give one header with a byte count")
        return int(raw)

    def _body(self) -> JSONDict:
        length = self._content_length()
        if length == 0:
            return {}
        limit = self.server.devbox.limits.request_bytes
        if length > limit:
            self.close_connection = True  # the body is never read
            raise ApiError(
                413, f"request body of {length} bytes is over the devbox limit of {limit}"
            )
        raw = self.rfile.read(length)
        if len(raw) != length:
            self.close_connection = True
            raise TimeoutError(f"body ended after {len(raw)} of {length} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
        return data

    def _send(self, status: int, payload: JSONDict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # http.server passes the raw request line (the whole URL) in args; only its path, with
        # secret-looking query values blanked, is logged, and the token nowhere, whatever
        # carried it. Headers are never logged.
        message = format % args
        raw_path = getattr(self, "path", "")
        if raw_path:
            message = message.replace(raw_path, _loggable_path(raw_path))
        # a request line too broken to parse is not in self.path; blank token-named values
        # wherever they appear, and the devbox's own token whatever carried it
        message = _TOKEN_VALUE.sub(r"\1=[redacted]", message)
        message = message.replace(self.server.token, "[token]")
        log.debug("devbox %s - %s", self.address_string(), message)


#: query parameter names refused outright: a token there would be logged and kept in histories.
_TOKEN_PARAMS = frozenset({"token", "access_token", "auth", "authorization", "bearer"})
_DIGITS = re.compile(r"[0-9]{1,18}")
_TOKEN_VALUE = re.compile(r"\b(" + "|".join(sorted(_TOKEN_PARAMS)) + r")=[^&\s\"']*", re.IGNORECASE)


def _loggable_path(path: str) -> str:
    """The request path with the values of secret-looking query parameters replaced."""
    url = urlsplit(path)
    if not url.query:
        return url.path
    parts = []
    for name, value in parse_qsl(url.query, keep_blank_values=True):
        secret = name.lower() in _TOKEN_PARAMS or is_secret_name(name)
        parts.append(f"{name}={'[redacted]' if secret else value}")
    return f"{url.path}?{'&'.join(parts)}"


class DevboxServer:
    """A devbox serving ``root`` over HTTP.

    Construction binds the socket (so ``url`` is known with ``port=0``), takes an exclusive lock
    on ``root`` (two devboxes on one root would mark each other's commands lost) and recovers:
    every command a previous devbox left ``running`` is reported ``lost``.
    """

    def __init__(
        self,
        root: Path,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        policy: CommandPolicy | None = None,
        limits: Limits | None = None,
        repos: RepoPolicy | None = None,
    ) -> None:
        check_token(token, "the devbox's token")  # a WeakToken (ValueError) names the minimum
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_root(self.root)
        try:
            self.devbox = Devbox(
                self.root, policy or CommandPolicy(), limits or Limits(), repos or RepoPolicy()
            )
            self.lost_on_start = self.devbox.commands.recover()
            self._http = _HTTPServer((host, port), _Handler)
        except BaseException:
            self._lock_file.close()
            raise
        self._http.devbox = self.devbox
        self._http.token = token
        self._http.slots = threading.BoundedSemaphore(self.devbox.limits.http_connections)
        self._thread: threading.Thread | None = None
        self._serving = False
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{name}]" if ":" in name else name
        return f"http://{shown}:{port}"

    def start(self) -> DevboxServer:
        """Serve from a background thread; returns at once."""
        self._thread = threading.Thread(target=self.serve_forever, name="devbox-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until ``stop()`` is called from another one."""
        self._serving = True
        self._http.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        """Stop serving, kill running commands (recorded ``lost``) and release the root."""
        if self._stopped:
            return
        self._stopped = True
        self._http.stopping = True
        if self._serving:
            self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self.devbox.commands.shutdown()
        self._lock_file.close()

    def __enter__(self) -> DevboxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _lock_root(root: Path) -> IO[str]:
    """Hold an exclusive lock on root for the devbox's lifetime; the kernel drops it on death."""
    handle = open(root / ".devbox.lock", "a+")  # noqa: SIM115 - held open until stop()
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(f"another devbox is already serving {root}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
