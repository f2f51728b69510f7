"""The model's tools, run in the devbox: where work runs, not where truth lives (I20).

Where a devbox is configured (``CHARLIE_DEVBOX_URL`` and ``CHARLIE_DEVBOX_TOKEN`` in the worker's
environment when ``charlie.tools`` is imported), this module replaces the local ``run_command``,
``read_file``, ``write_file`` and ``list_files`` with devbox-backed tools of the same names and
parameters, and adds ``apply_patch``, ``git_diff`` and ``git_commit``. The model sees one tool set
whichever backs it; without a devbox the local tools stay.

What a task's workspace is built from comes from its durable metadata, never from a worker's
memory::

    charlie.submit(..., metadata={"devbox": {
        "repo": "/srv/git/confparse.git",   # a source the devbox allows (--allow-repo); omit:
                                            # an empty repository
        "branch": "fix/hash-comments",      # checked out (created at base_commit if new)
        "base_commit": "3f2a...",           # pins the checkout; give it for exact rebuilds
    }})

Which workspace it is, is not the metadata's to choose: its id is derived from
the id of the task that owns it, the task itself or, for a delegated child, the task at the top
of its chain of parents (``tasks.parent_id``, written by the engine, never by a producer). A
``workspace_id`` in the metadata is accepted only when it is that one. Every request to the
devbox carries the workspace's own credential, derived from CHARLIE_DEVBOX_TOKEN, which the
devbox refuses for any other workspace or command.

Every tool call asks the devbox to ensure that workspace (idempotent, cheap when it exists), so a
run resumed on another worker, or after the devbox lost the workspace, finds or rebuilds it from
what the database records. Delegated children inherit the parent's workspace (``delegate``
copies ``metadata["devbox"]`` with the workspace id filled in).

``run_command`` is a resumable wait (I10, I20): the first invocation starts the command, records
its execution id on the call before anything else, observes it briefly and otherwise parks; any
later invocation (the sweep's poll, or a resume after the worker died) only polls that id. A
start carries an idempotency key derived from the call, and a resume that finds no id recorded
never starts anything: it looks the key up on the devbox, observes the command found there, and
otherwise settles the call ``interrupted`` (the devbox seals the key, so no start of it runs
later). A crash between the devbox starting the command and the id being recorded, or a devbox
that lost its records, therefore never runs a command twice. ``git_commit``
writes an idempotency key as a trailer and has a reconcile hook that reads back whether that
commit exists, so an interrupted commit settles done or not done instead of unknown.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from charlie import faults
from charlie.config import Settings, load_settings, settings
from charlie.devbox.client import (
    CommandStatus,
    DevboxClient,
    DevboxError,
    DevboxUnavailable,
    FileEntry,
    Workspace,
)
from charlie.devbox.credentials import WeakToken, check_token
from charlie.domain import JSON, Outcome
from charlie.sandbox import network_allowed
from charlie.tools.context import (
    Interrupted,
    LeaseLost,
    NoChildren,
    Pending,
    Reconciled,
    ToolContext,
    ToolError,
)
from charlie.tools.registry import REGISTRY, ToolRegistry, build_tool

#: the most of a file read_file returns, and of each output stream run_command returns (the
#: local tools' limits, so results are the same size whichever backs them).
MAX_READ_BYTES = 200_000
OUTPUT_TAIL_BYTES = 20_000
#: list_files stops after this many entries, or this many directories, like the local one.
MAX_LIST_ENTRIES = 2000
MAX_LIST_DIRS = 500
#: the keys ``metadata["devbox"]`` may carry.
METADATA_KEYS = ("repo", "branch", "base_commit", "workspace_id")

_WORKSPACE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY = re.compile(r"\S{1,200}")

T = TypeVar("T")


# -- configuration and the client ------------------------------------------------------------


@dataclass(frozen=True)
class DevboxConfig:
    url: str
    token: str
    timeout: float
    inline_wait: float
    poll_interval: float

    @classmethod
    def from_settings(cls, s: Settings) -> DevboxConfig | None:
        if not s.devbox_url:
            return None
        return cls(
            url=s.devbox_url,
            token=s.devbox_token or "",
            timeout=s.devbox_timeout,
            inline_wait=max(0.0, s.devbox_inline_wait),
            poll_interval=max(0.1, s.devbox_poll_interval),
        )


def current_config() -> DevboxConfig:
    """The devbox this process's tools use (from its settings)."""
    config = DevboxConfig.from_settings(settings())
    if config is None:
        raise ToolError("no devbox is configured for this worker (CHARLIE_DEVBOX_URL is unset)")
    if not config.token:
        raise ToolError("CHARLIE_DEVBOX_URL is set but CHARLIE_DEVBOX_TOKEN is not")
    try:
        check_token(config.token)
    except WeakToken as exc:
        raise ToolError(f"the devbox is misconfigured on this worker: {exc}") from None
    return config


_clients: dict[tuple[int, str, str, float], DevboxClient] = {}
_clients_lock = threading.Lock()


def client_for(config: DevboxConfig) -> DevboxClient:
    """One HTTP client per process and devbox (a connection pool, not a cache of any truth);
    keyed by pid so a forked pool child never shares its parent's connections."""
    digest = hashlib.sha256(config.token.encode()).hexdigest()
    key = (os.getpid(), config.url, digest, config.timeout)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            try:
                client = _clients[key] = DevboxClient(config.url, config.token, config.timeout)
            except ValueError as exc:
                raise ToolError(f"the devbox is misconfigured: {exc}") from None
        return client


# -- the task's workspace, from durable metadata ---------------------------------------------


@dataclass(frozen=True)
class WorkspaceSpec:
    """What the database records about a task's devbox workspace (``metadata["devbox"]``)."""

    workspace_id: str
    repo: str | None = None
    branch: str | None = None
    base_commit: str | None = None

    def as_metadata(self) -> JSON:
        return {
            k: v
            for k, v in (
                ("workspace_id", self.workspace_id),
                ("repo", self.repo),
                ("branch", self.branch),
                ("base_commit", self.base_commit),
            )
            if v is not None
        }


def workspace_id_for(task_id: str) -> str:
    """A devbox workspace id derived from the task id alone, so any worker derives the same one.
    Task ids that are not already valid workspace ids get a short hash so two never collide."""
    if _WORKSPACE_ID.fullmatch(task_id) and ".." not in task_id:
        return task_id
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", task_id).replace("..", "-").lstrip("._-") or "task"
    return f"{safe[:100]}-{hashlib.sha256(task_id.encode()).hexdigest()[:12]}"


#: task id -> its parent's (None for a top-level task): fixed at submit, so safe to keep.
_parents: dict[str, str | None] = {}
_parents_lock = threading.Lock()
MAX_DELEGATION_DEPTH = 64


def workspace_owner(ctx: ToolContext) -> str:
    """The task whose workspace this call works in: the top of the task's chain of parents
    (a delegated child shares its parent's workspace), followed through the engine's records,
    never through metadata. A context without a Children port (built by hand) owns its own."""
    if isinstance(ctx.children, NoChildren):
        return ctx.task_id
    task_id = ctx.task_id
    for _ in range(MAX_DELEGATION_DEPTH):
        with _parents_lock:
            known = task_id in _parents
            parent = _parents.get(task_id)
        if not known:
            snapshot = ctx.children.get(task_id)
            if snapshot is None:
                raise ToolError(f"task {task_id} is gone; its workspace cannot be named")
            parent = snapshot.parent_id
            with _parents_lock:
                _parents[task_id] = parent
        if parent is None:
            return task_id
        task_id = parent
    raise ToolError(f"task {ctx.task_id} is delegated more than {MAX_DELEGATION_DEPTH} deep")


def task_workspace(ctx: ToolContext) -> WorkspaceSpec:
    """The call's workspace spec: built from the task's metadata, named after its owner."""
    return workspace_spec(ctx.task_id, ctx.metadata, owner=workspace_owner(ctx))


def workspace_spec(task_id: str, metadata: JSON, owner: str | None = None) -> WorkspaceSpec:
    """The task's workspace spec from its metadata; a malformed one is a clear tool error.
    The workspace id is derived from ``owner`` (the task at the top of its chain of parents;
    ``task_id`` when not given); a ``workspace_id`` in the metadata must be that same id."""
    raw = metadata.get("devbox")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ToolError(
            "task metadata 'devbox' must be an object like {'repo': ..., 'branch': ...}"
        )
    unknown = sorted(set(raw) - set(METADATA_KEYS))
    if unknown:
        raise ToolError(
            f"task metadata 'devbox' has unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(METADATA_KEYS)}"
        )
    values: dict[str, str | None] = {}
    for key in METADATA_KEYS:
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ToolError(f"task metadata devbox.{key} must be a non-empty string")
        values[key] = value
    derived = workspace_id_for(owner or task_id)
    if values["workspace_id"] is not None and values["workspace_id"] != derived:
        raise ToolError(
            f"task metadata devbox.workspace_id {values['workspace_id']!r} is not this task's "
            f"workspace: a task works only in its own ({derived!r}, from the id of the task "
            "that owns it); leave workspace_id out"
        )
    return WorkspaceSpec(
        workspace_id=derived,
        repo=values["repo"],
        branch=values["branch"],
        base_commit=values["base_commit"],
    )


def devbox_metadata(
    repo: str | None = None,
    *,
    branch: str | None = None,
    base_commit: str | None = None,
    workspace_id: str | None = None,
) -> JSON:
    """``metadata["devbox"]`` for ``charlie.submit``. A local repository path is made absolute
    and, without ``base_commit``, pinned to the commit its ``branch`` (or HEAD) names now, so a
    workspace rebuilt later is the same checkout. ``workspace_id``, when given, must be the
    one derived from the task id (``workspace_id_for``); the tools refuse any other."""
    if repo is not None and "://" not in repo and os.path.isdir(repo):
        repo = os.path.abspath(repo)
        # a branch the repository does not have yet is created at its HEAD
        for rev in [branch, "HEAD"] if base_commit is None and branch else ["HEAD"]:
            if base_commit is not None:
                break
            done = subprocess.run(
                ["git", "-C", repo, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"],
                capture_output=True,
                text=True,
                check=False,
            )
            base_commit = done.stdout.strip() or None
    spec = {"repo": repo, "branch": branch, "base_commit": base_commit}
    if workspace_id is not None:
        spec["workspace_id"] = workspace_id
    return {k: v for k, v in spec.items() if v is not None}


def inherited_devbox(ctx: ToolContext, metadata: JSON) -> JSON | None:
    """What a delegated child of the call's task (whose metadata is ``metadata``) records as its
    ``metadata["devbox"]``: the parent's spec with the workspace id spelled out, so parent and
    child share one workspace (the child derives the same id from its chain of parents).
    ``None`` when the parent uses no devbox."""
    if "devbox" not in metadata and not settings().devbox_url:
        return None
    return workspace_spec(ctx.task_id, metadata, owner=workspace_owner(ctx)).as_metadata()


def _client(ctx: ToolContext, spec: WorkspaceSpec | None = None) -> DevboxClient:
    """This process's client for the devbox, speaking with the credential of the call's own
    workspace only."""
    spec = spec or task_workspace(ctx)
    return client_for(current_config()).for_workspace(spec.workspace_id)


@dataclass(frozen=True)
class _Box:
    client: DevboxClient
    spec: WorkspaceSpec
    workspace: Workspace
    rebuilt: str | None

    @property
    def id(self) -> str:
        return self.spec.workspace_id


def _open(ctx: ToolContext, what: str) -> _Box:
    """The task's workspace, created or rebuilt from the task's metadata if the devbox has none.

    ``rebuilt`` says so when that happened after the task had started using it (a later turn,
    or a delegated child): whatever was changed in it before is gone."""
    spec = task_workspace(ctx)
    client = _client(ctx, spec)
    with _calling(what):
        workspace = _retry(
            lambda: client.ensure_workspace(
                spec.workspace_id, spec.repo, branch=spec.branch, base_commit=spec.base_commit
            )
        )
    rebuilt = None
    if workspace.created and (ctx.turn > 0 or "delegated_by" in ctx.metadata):
        source = spec.repo or "an empty repository"
        at = f" at {spec.base_commit}" if spec.base_commit else ""
        rebuilt = (
            f"the devbox had no workspace {spec.workspace_id!r}, so it was rebuilt from {source}"
            f"{at}; changes made in it earlier in this task are gone and need redoing"
        )
    return _Box(client, spec, workspace, rebuilt)


# -- errors and retries ----------------------------------------------------------------------


@contextmanager
def _calling(what: str) -> Iterator[None]:
    """Devbox failures as tool errors the model can act on (I15); never the token."""
    try:
        yield
    except DevboxUnavailable as exc:
        raise ToolError(f"{what}: {exc}; try again later", devbox="unreachable") from None
    except DevboxError as exc:
        if exc.status == 401:
            raise ToolError(
                f"{what}: the devbox refused this worker's credentials ({exc.message}); "
                "check CHARLIE_DEVBOX_TOKEN",
                devbox_status=401,
            ) from None
        raise ToolError(f"{what}: {exc.message}", devbox_status=exc.status) from None


def _retry(fn: Callable[[], T], attempts: int = 3) -> T:
    """For requests that are safe to repeat (reads, idempotent writes, keyed starts): the
    devbox being briefly unreachable or failing with a 5xx is retried a couple of times."""
    for attempt in range(attempts):
        try:
            return fn()
        except DevboxUnavailable:
            if attempt == attempts - 1:
                raise
        except DevboxError as exc:
            if not exc.transient or attempt == attempts - 1:
                raise
        time.sleep(0.2 * 3**attempt)
    raise AssertionError("unreachable")


def call_key(ctx: ToolContext) -> str:
    """The idempotency key of one tool call: the task, the turn and the call id, so the same
    call asking again (after a crash) gets the same key and no other call ever does."""
    key = f"charlie:{ctx.task_id}/{ctx.turn}/{ctx.call_id}"
    if _KEY.fullmatch(key):
        return key
    return "charlie:sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# -- files -----------------------------------------------------------------------------------


def read_file(path: str, ctx: ToolContext) -> str | JSON:
    """Read a text file in the workspace."""
    box = _open(ctx, "read_file")
    with _calling("read_file"):
        found = _retry(lambda: box.client.read_file(box.id, path))
    content = found.content
    if len(content) > MAX_READ_BYTES:
        content = content[:MAX_READ_BYTES] + (
            f"\n[truncated: file is {found.size} bytes, showing the first {MAX_READ_BYTES}]"
        )
    if box.rebuilt:
        return {"content": content, "workspace_rebuilt": box.rebuilt}
    return content


def write_file(path: str, content: str, ctx: ToolContext) -> JSON:
    """Write a text file in the workspace, replacing it if it exists."""
    box = _open(ctx, "write_file")
    with _calling("write_file"):
        # A whole-file write is idempotent, so a retry cannot do anything the first did not.
        size = _retry(lambda: box.client.write_file(box.id, path, content))
    return _noted({"path": path, "bytes": size}, box)


def list_files(ctx: ToolContext, path: str = ".") -> list[str] | JSON:
    """List files under a directory of the workspace (recursively, hidden entries skipped)."""
    box = _open(ctx, "list_files")

    def entries(directory: str) -> list[FileEntry]:
        return _retry(lambda: box.client.list_files(box.id, directory))

    found: list[str] = []
    pending = [posixpath.normpath(path or ".")]
    visited = 0
    with _calling("list_files"):
        while pending and len(found) <= MAX_LIST_ENTRIES and visited < MAX_LIST_DIRS:
            directory = pending.pop(0)
            visited += 1
            prefix = "" if directory == "." else directory + "/"
            subdirs = []
            for entry in entries(directory):
                if entry.name.startswith("."):
                    continue
                if entry.type == "dir":
                    subdirs.append(prefix + entry.name)
                else:
                    found.append(prefix + entry.name)
            pending = subdirs + pending  # depth-first, sorted, like the local walk
    found.sort()
    if len(found) > MAX_LIST_ENTRIES or pending:
        found = [*found[:MAX_LIST_ENTRIES], f"[truncated at {MAX_LIST_ENTRIES} entries]"]
    if box.rebuilt:
        return {"files": found, "workspace_rebuilt": box.rebuilt}
    return found


def _noted(result: JSON, box: _Box) -> JSON:
    return {**result, "workspace_rebuilt": box.rebuilt} if box.rebuilt else result


# -- git -------------------------------------------------------------------------------------


def apply_patch(diff: str, ctx: ToolContext) -> JSON:
    """Apply a unified diff (as ``git diff`` prints it) to the workspace.

    Nothing is changed if any hunk does not apply."""
    box = _open(ctx, "apply_patch")
    with _calling("apply_patch"):
        # Not retried: a retry after a lost answer would find the patch already applied.
        applied = box.client.apply_patch(box.id, diff)
    return _noted({"applied": True, "files": list(applied.files)}, box)


def git_diff(ctx: ToolContext) -> JSON:
    """Show the workspace's uncommitted changes (``git diff HEAD``) and untracked files."""
    box = _open(ctx, "git_diff")
    with _calling("git_diff"):
        diff = _retry(lambda: box.client.diff(box.id))
    return _noted(
        {"diff": diff.diff, "untracked": list(diff.untracked), "truncated": diff.truncated}, box
    )


def _commit_landed(message: str, ctx: ToolContext) -> Reconciled | None:
    """I10 read-back for an interrupted git_commit: does a commit carry this call's key?"""
    spec = task_workspace(ctx)
    key = call_key(ctx)
    client = _client(ctx, spec)
    try:
        # sealed: a holder paused before its commit reached the devbox cannot commit later
        commit = _retry(lambda: client.find_commit(spec.workspace_id, key, seal=True))
    except DevboxUnavailable:
        return None  # cannot tell: the call settles interrupted, with its evidence
    except DevboxError as exc:
        if exc.status == 404:
            return Reconciled(
                Outcome.ERROR,
                {
                    "error": f"not committed: the devbox has no workspace {spec.workspace_id!r} "
                    "any more, so no commit of this call exists",
                    "idempotency_key": key,
                },
            )
        return None
    if commit is None:
        return Reconciled(
            Outcome.ERROR,
            {
                "error": "not committed: no commit carries this call's idempotency key; "
                "commit again",
                "idempotency_key": key,
            },
        )
    return Reconciled(Outcome.OK, {"commit": commit, "created": True, "idempotency_key": key})


def git_commit(message: str, ctx: ToolContext) -> JSON:
    """Commit all changes in the workspace with ``message`` and return the commit id."""
    box = _open(ctx, "git_commit")
    if box.rebuilt:
        raise ToolError(f"git_commit: nothing committed: {box.rebuilt}")
    key = call_key(ctx)
    if not ctx.holds_lease():
        # Another worker took this call over (its reconcile may have answered "not
        # committed"): committing now would contradict it.
        raise LeaseLost("git_commit: nothing committed: this attempt lost the call's lease")
    with _calling("git_commit"):
        # Safe to retry: the devbox returns the first commit made with this key.
        done = _retry(lambda: box.client.commit(box.id, message, key))
    # After the commit landed and before the call settles: where a crash leaves the call
    # started without a result, and the reconcile hook has to find the commit.
    faults.hit("devbox.after_commit", tool="git_commit", call_id=ctx.call_id)
    return {
        "commit": done.commit,
        "created": done.created,
        "branch": box.workspace.branch,
        "idempotency_key": key,
    }


# -- commands --------------------------------------------------------------------------------


def run_command(command: str, ctx: ToolContext, timeout: float = 120.0) -> JSON | Pending:
    """Run a shell command in the workspace and wait for it (up to ``timeout`` seconds).

    A non-zero exit code is a tool error the model sees, with the output."""
    config = current_config()
    client = _client(ctx)
    rebuilt = None
    if ctx.handle is None and ctx.resumed:
        # An earlier attempt died between starting the command and recording its id, or
        # before starting it: which, only the devbox's key files can say. A resume never
        # starts a command: it looks the key up, and observes what it finds.
        ctx.record_handle(_started_earlier(client, ctx))
    elif ctx.handle is None:
        box = _open(ctx, "run_command")
        rebuilt = box.rebuilt
        if not ctx.holds_lease():
            raise LeaseLost("run_command: not started: this attempt lost the call's lease")
        with _calling("run_command"):
            # Keyed by the call: if an earlier attempt of this call started the command but
            # died before recording its id, this returns that command instead of a second one.
            started = _retry(
                lambda: client.start_command(
                    box.id,
                    shell=command,
                    timeout=timeout,
                    idempotency_key=call_key(ctx),
                    network=network_allowed(ctx.metadata),
                )
            )
        # The one window where a crash leaves the command unrecorded: the keyed start above
        # is what makes the attempt after it find this same command.
        faults.hit("devbox.before_record_handle", tool="run_command", call_id=ctx.call_id)
        # Durable before anything else: every later attempt observes this command (I20).
        ctx.record_handle(started.execution_id)
        faults.hit("devbox.after_command_started", tool="run_command", call_id=ctx.call_id)
    # From here on the command is only ever observed, never started again.
    assert ctx.handle is not None
    return _observe(client, config, ctx, ctx.handle, rebuilt)


def _started_earlier(client: DevboxClient, ctx: ToolContext) -> str:
    """The execution id of the command an earlier attempt of this call started under its key;
    Interrupted when the devbox cannot confirm one (it has no such key: never started, or its
    records were lost with its root), so the command is never started a second time. The
    lookup seals the key, so a start of this call still on its way is refused too."""
    spec = task_workspace(ctx)
    key = call_key(ctx)
    evidence: JSON = {"idempotency_key": key, "workspace_id": spec.workspace_id}
    try:
        found = _retry(lambda: client.find_command(spec.workspace_id, key))
    except (DevboxUnavailable, DevboxError) as exc:
        raise Interrupted(
            "run_command: an earlier attempt of this call stopped before recording its "
            "command's execution id, and the devbox could not be asked whether it started it "
            f"({exc}); the command was not started again and its outcome is unknown",
            **evidence,
        ) from None
    if found is None:
        raise Interrupted(
            "run_command: an earlier attempt of this call stopped before recording its "
            "command's execution id, and the devbox has no command under the call's "
            "idempotency key (never started, or the devbox lost its records); the command was "
            "not started again and its outcome is unknown: run it again if that is safe",
            **evidence,
            sealed=True,
        )
    return found.execution_id


def _observe(
    client: DevboxClient, config: DevboxConfig, ctx: ToolContext, eid: str, rebuilt: str | None
) -> JSON | Pending:
    """Poll the command for up to ``inline_wait``; finished: its result; else park the call."""
    # An overdue call's look (the late watch) is one status poll: it holds no worker to wait.
    until = time.monotonic() + (0.0 if ctx.overdue else config.inline_wait)
    delay = 0.05
    polls = 0
    while True:
        if ctx.lease_lost.is_set():
            # Another worker observes the command now, or the call was settled: stop watching
            # (the command itself runs on; it is not ours to stop, I13).
            raise LeaseLost(
                "run_command: stopped observing: this attempt lost the call's lease",
                execution_id=eid,
            )
        status: CommandStatus | None = None
        polls += 1
        try:
            status = client.command_status(eid, tail=OUTPUT_TAIL_BYTES)
        except DevboxUnavailable:
            pass  # the devbox may be restarting: keep observing; the tool deadline bounds this
        except DevboxError as exc:
            if exc.status == 404:
                raise ToolError(
                    f"the devbox has no record of command {eid} (it was replaced or its records "
                    "were removed); the command's outcome is unknown and it was not run again",
                    execution_id=eid,
                ) from None
            if not exc.transient:
                raise ToolError(f"run_command: {exc.message}", execution_id=eid) from None
        if status is not None and status.done:
            return _finished(status, ctx, polls, rebuilt)
        left = until - time.monotonic()
        if left <= 0:
            return Pending(handle=eid, poll_after=config.poll_interval)
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.5)


def _finished(status: CommandStatus, ctx: ToolContext, polls: int, rebuilt: str | None) -> JSON:
    result: JSON = {
        "exit_code": status.exit_code,
        "stdout": status.stdout_tail,
        "stderr": status.stderr_tail,
        "status": status.status,
        "execution_id": status.execution_id,
        "started_at": status.started_at,
        "finished_at": status.finished_at,
        # which worker saw the end, and whether it picked the observation up from another
        "observed_by": _worker(),
        "resumed": ctx.resumed,
        "polls": polls,
    }
    if status.truncated:
        result["truncated"] = True
        result["note"] = (
            f"output beyond the devbox's cap was dropped (the command wrote {status.stdout_bytes}"
            f" bytes to stdout and {status.stderr_bytes} to stderr)"
        )
    if status.reason:
        result["reason"] = status.reason
    if rebuilt:
        result["workspace_rebuilt"] = rebuilt
    if status.status == "lost":
        raise ToolError(
            "the devbox restarted while the command was running, so its outcome is unknown; "
            "it was not run again (run it again if that is safe)",
            **result,
        )
    if status.status == "timed_out":
        raise ToolError(f"command timed out: {status.reason or 'killed by the devbox'}", **result)
    if status.status == "cancelled":
        raise ToolError("command was cancelled on the devbox", **result)
    if status.status == "killed":
        raise ToolError(f"command {status.reason or 'killed by the devbox'}", **result)
    if status.exit_code != 0:
        raise ToolError(f"command exited with code {status.exit_code}", **result)
    return result


# -- registration ----------------------------------------------------------------------------


#: what a devbox tool talks to (ToolDef.remote): a replay runs none of them (I35)
DEVBOX = "devbox"


def install(registry: ToolRegistry = REGISTRY, s: Settings | None = None) -> None:
    """Put the devbox's tools in ``registry`` in place of the local ones of the same names."""
    s = s or load_settings()
    # Every call is its own request to the devbox, which serves requests concurrently.
    for definition in (
        build_tool(read_file, effect="read", deadline=60, threadsafe=True, remote=DEVBOX),
        build_tool(list_files, effect="read", deadline=120, threadsafe=True, remote=DEVBOX),
        build_tool(write_file, effect="write", deadline=60, threadsafe=True, remote=DEVBOX),
        build_tool(apply_patch, effect="write", deadline=120, threadsafe=True, remote=DEVBOX),
        build_tool(git_diff, effect="read", deadline=120, threadsafe=True, remote=DEVBOX),
        build_tool(
            git_commit,
            effect="write",
            deadline=120,
            reconcile=_commit_landed,
            threadsafe=True,
            remote=DEVBOX,
        ),
        build_tool(
            run_command,
            effect="wait",
            resumable=True,
            deadline=s.devbox_command_deadline,
            threadsafe=True,
            remote=DEVBOX,
        ),
    ):
        registry.replace(definition)


def _configured_at_import() -> Settings | None:
    # load_settings, not settings(): importing charlie must not freeze the process's settings.
    if not os.environ.get("CHARLIE_DEVBOX_URL"):
        return None
    return load_settings()


_settings_at_import = _configured_at_import()
if _settings_at_import is not None:
    install(REGISTRY, _settings_at_import)


__all__ = [
    "DevboxConfig",
    "WorkspaceSpec",
    "call_key",
    "client_for",
    "current_config",
    "devbox_metadata",
    "inherited_devbox",
    "install",
    "task_workspace",
    "workspace_id_for",
    "workspace_owner",
    "workspace_spec",
]
