"""A typed client for the devbox HTTP API, used by Charlie's tools from any worker.

Every method is one HTTP request. The client holds no state about commands: an execution id is
all a worker needs to poll a command another (possibly dead) worker started.

Failures are split the way the executor needs them: ``DevboxError`` means the devbox answered
and refused (its status and message say why; 5xx may be worth retrying), ``DevboxUnavailable``
means it could not be reached at all (transient: connection refused, timeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from charlie.devbox.credentials import workspace_credential

TERMINAL_STATUSES = frozenset({"exited", "timed_out", "cancelled", "lost", "killed"})


class DevboxError(Exception):
    """The devbox answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"devbox error {status}: {message}")
        self.status = status
        self.message = message

    @property
    def transient(self) -> bool:
        """5xx: the devbox failed, not the request; a retry may succeed."""
        return self.status >= 500


class DevboxUnavailable(Exception):
    """The devbox could not be reached (connection refused, reset, or timed out)."""


@dataclass(frozen=True)
class Workspace:
    workspace_id: str
    path: str
    head: str | None
    branch: str | None
    #: True when this request built it (first use, or again after the devbox lost it).
    created: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class StartedCommand:
    execution_id: str
    status: str
    timeout: float
    #: False when an earlier start with the same idempotency key is what came back.
    created: bool = True


@dataclass(frozen=True)
class CommandStatus:
    execution_id: str
    status: str  # running | exited | timed_out | cancelled | lost | killed
    exit_code: int | None
    started_at: str
    finished_at: str | None
    stdout_tail: str
    stderr_tail: str
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    reason: str | None = None
    workspace_id: str | None = None
    pid: int | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def succeeded(self) -> bool:
        return self.status == "exited" and self.exit_code == 0


@dataclass(frozen=True)
class FileContent:
    path: str
    content: str
    size: int
    binary: bool


@dataclass(frozen=True)
class FileEntry:
    name: str
    type: str  # file | dir | symlink | other
    size: int | None


@dataclass(frozen=True)
class PatchResult:
    files: tuple[str, ...]


@dataclass(frozen=True)
class Diff:
    diff: str
    untracked: tuple[str, ...]
    truncated: bool


@dataclass(frozen=True)
class CommitResult:
    commit: str
    created: bool


class DevboxClient:
    def __init__(
        self, base_url: str, token: str, timeout: float = 30.0, *, _http: httpx.Client | None = None
    ) -> None:
        if not token or not all(33 <= ord(ch) < 127 for ch in token):
            # checked here because httpx would put the header value in its error message
            raise ValueError("devbox token must be non-empty printable ASCII without spaces")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._auth = {"Authorization": f"Bearer {token}"}
        self._owns_http = _http is None
        self._http = _http or httpx.Client(base_url=self.base_url, timeout=timeout)

    def __repr__(self) -> str:
        return f"DevboxClient({self.base_url!r})"  # never the token

    def for_workspace(self, workspace_id: str) -> DevboxClient:
        """A client that speaks for one workspace only, with its credential derived from this
        client's token: the devbox refuses it anything else with a 403. It
        shares this client's connections; closing it leaves them open."""
        return DevboxClient(
            self.base_url, workspace_credential(self._token, workspace_id), _http=self._http
        )

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> DevboxClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- workspaces ----------------------------------------------------------------------------

    def ensure_workspace(
        self,
        workspace_id: str,
        repo: str | None = None,
        *,
        branch: str | None = None,
        base_commit: str | None = None,
        copy_from: str | None = None,
    ) -> Workspace:
        """Create the workspace (clone ``repo``; ``None`` for an empty one; or copy a directory),
        or return it if it already exists with the same spec."""
        body: dict[str, Any] = {"branch": branch, "base_commit": base_commit}
        if copy_from is not None:
            body["copy_from"] = copy_from
        else:
            body["repo"] = repo
        return _workspace(self._call("PUT", _ws(workspace_id), json=body))

    def get_workspace(self, workspace_id: str) -> Workspace:
        return _workspace(self._call("GET", _ws(workspace_id)))

    # -- commands ------------------------------------------------------------------------------

    def start_command(
        self,
        workspace_id: str,
        argv: list[str] | None = None,
        *,
        shell: str | None = None,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        idempotency_key: str | None = None,
        network: bool = False,
    ) -> StartedCommand:
        """Start ``argv`` (or a ``shell`` string); returns its execution id without waiting.

        With ``idempotency_key``, starting again with the same key in the same workspace returns
        the first command (``created=False``) instead of running a second one, so a start whose
        answer was lost may be retried."""
        body: dict[str, Any] = {"argv": argv, "shell": shell, "timeout": timeout, "env": env}
        if cwd is not None:
            body["cwd"] = cwd
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        if network:
            body["network"] = True  # the devbox gives it only when started --allow-network
        data = self._call("POST", f"{_ws(workspace_id)}/commands", json=body)
        return StartedCommand(
            data["execution_id"], data["status"], data["timeout"], bool(data.get("created", True))
        )

    def find_command(self, workspace_id: str, idempotency_key: str) -> StartedCommand | None:
        """The command started under ``idempotency_key`` in the workspace, or None; never starts
        one. None also seals the key: a start with it from now on is refused (409), so a caller
        that reports "not confirmed" cannot be contradicted by a start still on its way."""
        data = self._call(
            "POST",
            f"{_ws(workspace_id)}/commands/lookup",
            json={"idempotency_key": idempotency_key},
        )
        if data.get("execution_id") is None:
            return None
        return StartedCommand(data["execution_id"], data["status"], data["timeout"], False)

    def command_status(self, execution_id: str, *, tail: int | None = None) -> CommandStatus:
        params = {"tail": tail} if tail is not None else None
        return _status(self._call("GET", f"/commands/{quote(execution_id)}", params=params))

    def cancel_command(self, execution_id: str) -> CommandStatus:
        return _status(self._call("POST", f"/commands/{quote(execution_id)}/cancel"))

    def wait_command(
        self, execution_id: str, *, timeout: float = 60.0, poll_interval: float = 0.1
    ) -> CommandStatus:
        """Poll until the command is done or ``timeout`` passes (then return it still running)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.command_status(execution_id)
            if status.done or time.monotonic() >= deadline:
                return status
            time.sleep(poll_interval)

    # -- files ---------------------------------------------------------------------------------

    def read_file(self, workspace_id: str, path: str) -> FileContent:
        data = self._call("GET", f"{_ws(workspace_id)}/files", params={"path": path})
        return FileContent(data["path"], data["content"], data["size"], data["binary"])

    def write_file(self, workspace_id: str, path: str, content: str) -> int:
        """Write the file whole; returns its size in bytes."""
        data = self._call(
            "PUT", f"{_ws(workspace_id)}/files", params={"path": path}, json={"content": content}
        )
        return int(data["size"])

    def list_files(self, workspace_id: str, path: str = ".") -> list[FileEntry]:
        data = self._call("GET", f"{_ws(workspace_id)}/list", params={"path": path})
        return [FileEntry(e["name"], e["type"], e["size"]) for e in data["entries"]]

    # -- git -----------------------------------------------------------------------------------

    def apply_patch(self, workspace_id: str, diff: str) -> PatchResult:
        data = self._call("POST", f"{_ws(workspace_id)}/patch", json={"diff": diff})
        return PatchResult(tuple(data["files"]))

    def diff(self, workspace_id: str) -> Diff:
        data = self._call("GET", f"{_ws(workspace_id)}/diff")
        return Diff(data["diff"], tuple(data["untracked"]), data["truncated"])

    def commit(self, workspace_id: str, message: str, idempotency_key: str) -> CommitResult:
        """Commit all changes once per key: a retry with the same key returns the first commit
        with ``created=False``."""
        data = self._call(
            "POST",
            f"{_ws(workspace_id)}/commit",
            json={"message": message, "idempotency_key": idempotency_key},
        )
        return CommitResult(data["commit"], data["created"])

    def find_commit(
        self, workspace_id: str, idempotency_key: str, *, seal: bool = False
    ) -> str | None:
        """The commit carrying this idempotency key in HEAD's history, or None (for reconcile).
        ``seal``: a key not found can never commit afterwards (a late holder's attempt is
        refused with 409), so "not committed" stays true."""
        params = {"idempotency_key": idempotency_key, **({"seal": "1"} if seal else {})}
        data = self._call("GET", f"{_ws(workspace_id)}/commits", params=params)
        commit: str | None = data["commit"]
        return commit

    def health(self) -> bool:
        return bool(self._call("GET", "/health").get("ok"))

    # -- transport -----------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        try:
            response = self._http.request(
                method, path, params=params, json=json, headers=self._auth
            )
        except httpx.TransportError as exc:
            # httpx's messages name the URL, never our headers, so the token stays out
            raise DevboxUnavailable(
                f"devbox at {self.base_url} unreachable: {type(exc).__name__}: {exc}"
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            message = data.get("error") if isinstance(data, dict) else None
            raise DevboxError(response.status_code, message or response.reason_phrase)
        if not isinstance(data, dict):
            raise DevboxError(response.status_code, "devbox answered with something not JSON")
        return data


def _ws(workspace_id: str) -> str:
    return f"/workspaces/{quote(workspace_id, safe='')}"


def _workspace(data: dict[str, Any]) -> Workspace:
    return Workspace(
        data["workspace_id"], data["path"], data["head"], data["branch"], bool(data.get("created"))
    )


def _status(data: dict[str, Any]) -> CommandStatus:
    return CommandStatus(
        execution_id=data["execution_id"],
        status=data["status"],
        exit_code=data["exit_code"],
        started_at=data["started_at"],
        finished_at=data["finished_at"],
        stdout_tail=data["stdout_tail"],
        stderr_tail=data["stderr_tail"],
        stdout_bytes=data["stdout_bytes"],
        stderr_bytes=data["stderr_bytes"],
        truncated=data["truncated"],
        reason=data.get("reason"),
        workspace_id=data.get("workspace_id"),
        pid=data.get("pid"),
    )
