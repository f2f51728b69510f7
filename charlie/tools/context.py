"""What a tool handler may know about the call it serves, and the errors it may raise."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from charlie.beneath import Outside, Root
from charlie.domain import JSON, Outcome, TaskStatus


class ToolError(Exception):
    """A tool failure to show the model as an ``error`` result (I15), with optional details."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details

    def as_result(self) -> JSON:
        return {**self.details, "error": str(self)}


class WorkspaceEscape(ToolError):
    pass


class Interrupted(ToolError):
    """The tool cannot tell what became of work an earlier attempt of this call may have
    started (I10): the call settles ``interrupted`` with these details as its evidence, and the
    model is shown the message, quoted. Never a reason to start the work again."""


class LeaseLost(ToolError):
    """This attempt no longer holds the call: its lease lapsed and another worker took the
    call over, or it was settled (a sweep, a deadline). The handler stops and does nothing more
    for the call. It is no report about the call's work, so nothing of it is recorded: not the
    outcome, not a late report (the late watch, or the new holder, reports the work's end)."""

    def as_result(self) -> JSON:
        return {**super().as_result(), "lease_lost": True}


def _always_held() -> bool:
    return True


@dataclass(frozen=True)
class Pending:
    """Returned by a resumable wait that is still waiting: the call stays open under the same
    identity and is observed again after ``poll_after`` seconds, or sooner when poked (a child
    task finishing pokes its parent's wait). Waiting this way holds no worker process."""

    handle: str
    poll_after: float = 2.0


@dataclass(frozen=True)
class AskPerson:
    """Returned by a started call whose outside work cannot go on without a person's answer
    (an MCP server's ``input_required``): the call parks held for a reply (``charlie.reply``),
    holding no worker and no lease (I25), and the tool is called again, as a resumed call
    with ``ctx.answer`` and ``ctx.asked`` set, once the answer is committed (I23, I24).

    ``state`` is what the tool needs to go on (kept with the question, handed back as
    ``ctx.asked``); ``handle`` names the outside work, if it has an identity (None: no handle
    while it waits). Only tools declared ``resumable`` or ``parks`` may ask."""

    question: str
    state: JSON = field(default_factory=dict)
    handle: str | None = None


@dataclass(frozen=True)
class Reconciled:
    """A reconcile hook's finding about a call found started without a result (I10)."""

    outcome: Outcome
    result: Any


@dataclass(frozen=True)
class TaskSnapshot:
    """A task as a tool sees it through :class:`Children` (a child it started, its parent)."""

    id: str
    status: TaskStatus
    result: Any
    error: Any
    model: str
    metadata: JSON
    #: the task that delegated it (None: submitted by a producer).
    parent_id: str | None = None
    #: the tools it may use (None: every registered tool).
    tools: list[str] | None = None

    @property
    def terminal(self) -> bool:
        return self.status.terminal


@dataclass(frozen=True)
class ChildSubmitted:
    task_id: str
    #: False: a task with this id existed already (a repeated delegate finds its child, I19).
    created: bool


class Children(Protocol):
    """The port through which a tool starts and reads tasks (delegation, I19).

    The engine hands one to every call in its ToolContext; the tool SDK imports nothing of the
    scheduler, the store or the API to do this, so tools run the same under
    :mod:`charlie.testing`, with a fake."""

    def get(self, task_id: str) -> TaskSnapshot | None:
        """The task, or None when there is none with this id."""
        ...

    def submit(
        self,
        *,
        prompt: str,
        model: str,
        tools: list[str] | None,
        task_id: str,
        metadata: JSON,
        parent_id: str,
        parent_call_id: str,
    ) -> ChildSubmitted:
        """Start a child task (idempotent on ``task_id``, whatever its parent's state since).
        Raises ToolError when it cannot: an unknown tool, a parent no longer active (I18)."""
        ...


class Record(Protocol):
    """The port through which a tool reads the run's durable record (the ``recall`` tool)."""

    def result_of(self, execution_id: str, call_id: str) -> JSON | None:
        """The recorded ``tool_result`` payload of a call of the run, or None."""
        ...


class NoRecord:
    def result_of(self, execution_id: str, call_id: str) -> JSON | None:
        raise ToolError("this tool context has no Record port (no transcript here)")


class NoChildren:
    """The Children of a context built without one: every use says so."""

    def get(self, task_id: str) -> TaskSnapshot | None:
        raise ToolError("this tool context has no Children port (no child tasks here)")

    def submit(self, **_: Any) -> ChildSubmitted:
        raise ToolError("this tool context has no Children port (no child tasks here)")


@dataclass
class ToolContext:
    task_id: str
    execution_id: str
    call_id: str
    turn: int
    workspace: Path
    #: the task's metadata (what the producer attached at submit).
    metadata: JSON
    #: True when this is a resumable wait dispatched again after a crash (I10).
    resumed: bool
    #: a handle recorded by an earlier attempt of this call (a child task id, a command id).
    handle: str | None
    _record_handle: Callable[[str], None] = field(repr=False)
    #: True when the call already settled past its deadline and this is one more look at its
    #: outside work, for the late report (I13). A resumable tool should look once and return
    #: (a Pending if the work still runs) rather than wait inline; a result or a ToolError is
    #: recorded as the work's end, any other exception means "look again later".
    overdue: bool = False
    #: starts and reads tasks (delegation); the engine's, or a fake under charlie.testing.
    children: Children = field(default_factory=NoChildren, repr=False)
    #: reads the run's durable transcript (the ``recall`` tool)
    record: Record = field(default_factory=NoRecord, repr=False)
    #: set once this attempt's lease on the call is seen lost (another worker took the call
    #: over, or it was settled): a long handler checks it and stops.
    lease_lost: threading.Event = field(default_factory=threading.Event, repr=False)
    _confirm_lease: Callable[[], bool] = field(default=_always_held, repr=False)
    #: a person's answer to the question this call parked with (an AskPerson), on the resumed
    #: call that the answer released; None otherwise. Acting on it is acting (I9): record a
    #: handle first, so an attempt after a crash knows it may have been acted on.
    answer: str | None = None
    #: the ``state`` of the AskPerson the answer is for (None without an answer).
    asked: JSON | None = None

    def holds_lease(self) -> bool:
        """Whether this attempt still holds the call: ask before an irreversible step (a
        commit, a start). Cheap while the lease is fresh; after a pause it asks the database.
        False: stop, and act no more for this call (raise LeaseLost)."""
        if self.lease_lost.is_set():
            return False
        if not self._confirm_lease():
            self.lease_lost.set()
            return False
        return True

    #: set when no tool may run for this call (its task's workspace lies outside the allowed
    #: roots): every handler is refused with this as the error the model sees (I15).
    refusal: str | None = None

    def record_handle(self, handle: str) -> None:
        """Durably record a handle on outside work before waiting on it, so a resumed attempt
        observes that same work (I19, I20). Raises LeaseLost when this attempt no longer holds
        the call (the handle of whoever holds it now stands)."""
        self._record_handle(handle)
        self.handle = handle

    def resolve(self, path: str) -> Path:
        """A path inside the workspace; anything that resolves outside it is refused.

        A check, not a guarantee: it resolves symlinks now, and the path it returns is opened
        by name later, when a command running in the workspace may have swapped a directory on
        it for a symlink that leads outside. Open, write and list with :meth:`open`,
        :meth:`read_text`, :meth:`write_text`, :meth:`listdir` or :meth:`root` instead, which
        resolve at the moment of the open (I33); use this one for a path to show, or to hand to
        a command that runs in the sandbox."""
        root = self.workspace.resolve()
        candidate = (root / path).resolve()
        if candidate != root and root not in candidate.parents:
            raise self._escape(path)
        return candidate

    # -- files, opened beneath the workspace by descriptor (I33) -------------------------------

    def _escape(self, path: str) -> WorkspaceEscape:
        return WorkspaceEscape(
            f"path {path!r} is outside the task's workspace", workspace=str(self.workspace)
        )

    def relative(self, path: str) -> str:
        """``path`` relative to the workspace: a relative path as it is, an absolute one that
        lies (as written) in the workspace made relative; any other absolute path is refused.
        Where it leads is decided by the open, not here."""
        if not isinstance(path, str) or "\x00" in path:
            raise ToolError(f"invalid path {path!r}")
        if not os.path.isabs(path):
            return path
        for base in (os.path.abspath(self.workspace), os.path.realpath(self.workspace)):
            rel = os.path.relpath(os.path.normpath(path), base)
            if rel != ".." and not rel.startswith("../"):
                return rel
        raise self._escape(path)

    @contextmanager
    def root(self) -> Iterator[Root]:
        """The workspace opened as a directory (:class:`charlie.beneath.Root`): every path its
        methods take is opened beneath it, no step of it outside, at the moment of the open.
        A path that leads outside raises :class:`WorkspaceEscape` out of the block."""
        try:
            root = Root(self.workspace)
        except OSError as exc:
            raise ToolError(f"cannot open the task's workspace: {exc.strerror}") from None
        try:
            with root:
                yield root
        except Outside as exc:
            raise self._escape(exc.path) from None

    def open(self, path: str, mode: str = "r", *, encoding: str | None = None) -> IO[Any]:
        """``open(path, mode)`` for a regular file of the workspace, safe against a command
        swapping symlinks in meanwhile: resolved beneath the workspace at the moment of the
        open (a symlink that stays inside is followed, one that leaves it raises
        :class:`WorkspaceEscape`). Modes as ``open()``'s (``r w a x``, ``+``, ``b``); a file
        is created, never its directory (:meth:`write_text` makes those). A FIFO, a device or
        a directory is refused rather than opened (OSError). Text mode defaults to UTF-8."""
        flags = _open_flags(mode)
        rel = self.relative(path)
        with self.root() as root:
            fd = root.open(rel, flags | os.O_NONBLOCK, 0o666)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            if "b" not in mode and encoding is None:
                encoding = "utf-8"
            return os.fdopen(fd, mode, encoding=encoding)
        except BaseException:
            os.close(fd)
            raise

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The text of a workspace file (see :meth:`open`)."""
        with self.open(path, "r", encoding=encoding) as f:
            return str(f.read())

    def write_text(self, path: str, text: str, encoding: str = "utf-8") -> None:
        """Replace a workspace file whole (its directories made as needed): written to a new
        file beside it and renamed over it, each step relative to the directory opened beneath
        the workspace, so a crash leaves the old file or the new one (I33)."""
        rel = self.relative(path)
        with self.root() as root:
            root.write_atomic(rel, text.encode(encoding))

    def listdir(self, path: str = ".") -> list[str]:
        """The names in a workspace directory, sorted (see :meth:`open`)."""
        rel = self.relative(path)
        with self.root() as root, root.scandir(rel) as entries:
            return sorted(entry.name for entry in entries)


def _open_flags(mode: str) -> int:
    """``os.open`` flags for an ``open()`` mode."""
    kinds = {"r": os.O_RDONLY, "w": os.O_CREAT | os.O_TRUNC, "a": os.O_CREAT | os.O_APPEND}
    kinds["x"] = os.O_CREAT | os.O_EXCL
    base = [c for c in mode if c in kinds]
    if len(base) != 1 or set(mode) - set("rwaxbt+") or len(set(mode)) != len(mode):
        raise ValueError(f"invalid mode: {mode!r}")
    (kind,) = base
    if "+" in mode:
        return kinds[kind] | os.O_RDWR
    return kinds[kind] | (os.O_RDONLY if kind == "r" else os.O_WRONLY)
