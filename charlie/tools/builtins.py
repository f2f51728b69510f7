"""The built-in local tools, confined to the task's workspace directory.

These run in the worker process. Where a devbox is configured its tools take their place; these
stay for the no-devbox case. Commands run in a sandbox (charlie/sandbox.py) unless the operator
opted out with CHARLIE_SANDBOX=off.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from charlie import sandbox
from charlie.beneath import Outside, Root
from charlie.config import Settings, settings
from charlie.devbox.policy import command_env
from charlie.domain import JSON
from charlie.tools.context import LeaseLost, ToolContext, ToolError
from charlie.tools.registry import tool

MAX_READ_BYTES = 200_000
OUTPUT_TAIL_BYTES = 20_000
#: list_files stops after this many entries; and reads at most this many of one directory.
MAX_LIST_ENTRIES = 2000
MAX_DIR_ENTRIES = 10_000


@tool(effect="read", deadline=60, threadsafe=True)
def read_file(path: str, ctx: ToolContext) -> str:
    """Read a text file in the workspace."""
    data, size = _read_head(ctx, path, MAX_READ_BYTES)
    if len(data) > MAX_READ_BYTES:
        return data[:MAX_READ_BYTES].decode(errors="replace") + (
            f"\n[truncated: file is {size} bytes, showing the first {MAX_READ_BYTES}]"
        )
    return data.decode(errors="replace")


def _read_head(ctx: ToolContext, path: str, limit: int) -> tuple[bytes, int]:
    """At most ``limit + 1`` bytes of a regular file (the extra byte says there is more) and
    its size: the file's size is the agent's to choose (a sparse file of 50 GB costs it
    nothing), so what is read must not be (result cap, I15). Opened beneath the workspace by
    descriptor (I33) and without blocking, so a directory swapped for a link since anyone
    looked is refused rather than followed out of the workspace, a FIFO not waited on."""
    rel = ctx.relative(path)
    try:
        with ctx.root() as root:
            return root.read_head(rel, limit)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ToolError(f"no such file: {path}") from None
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ToolError(f"no such file: {path}") from None  # a FIFO, a device
        raise ToolError(f"cannot read {path}: {exc.strerror}") from None


@tool(effect="write", deadline=60, threadsafe=True)
def write_file(path: str, content: str, ctx: ToolContext) -> JSON:
    """Write a text file in the workspace, replacing it if it exists."""
    # Write then rename, so a crash leaves the old file or the new one, never half of one; the
    # temporary file is made and renamed in the directory opened beneath the workspace (I33).
    data = content.encode()
    rel = ctx.relative(path)
    try:
        with ctx.root() as root:
            root.write_atomic(rel, data)
    except IsADirectoryError:
        raise ToolError(f"{path} is a directory") from None
    except OSError as exc:
        raise ToolError(f"cannot write {path}: {exc.strerror}") from None
    return {"path": path, "bytes": len(data)}


#: recall returns at most this many characters of a result at a time
RECALL_CHARS = 16_000


@tool(effect="read", deadline=60, threadsafe=True)
def recall(call_id: str, ctx: ToolContext, offset: int = 0) -> str:
    """Read again the recorded result of an earlier tool call of this task, by its call id:
    what an input elided or cut to fit the context window. Long results come a part at a time
    (``offset``: the character to start from)."""
    payload = ctx.record.result_of(ctx.execution_id, call_id)
    if not isinstance(payload, dict):
        raise ToolError(f"no recorded result for call {call_id!r} in this task")
    content = str(payload.get("content") or "")
    offset = max(0, offset)
    part = content[offset : offset + RECALL_CHARS]
    end = offset + len(part)
    if end < len(content):
        part += (
            f"\n[characters {offset}-{end} of {len(content)}; recall with offset={end} for more]"
        )
    return part


@tool(effect="read", deadline=60, threadsafe=True)
def list_files(ctx: ToolContext, path: str = ".") -> list[str]:
    """List files under a directory of the workspace (recursively, hidden entries skipped)."""
    start = posixpath.normpath(ctx.relative(path))
    found: list[str] = []
    crowded = False
    with ctx.root() as root:
        try:
            os.close(root.opendir(start))
        except OSError:
            raise ToolError(f"no such directory: {path}") from None
        pending = [start]  # depth-first, each directory's entries sorted, as os.walk went
        while pending and len(found) <= MAX_LIST_ENTRIES:
            directory = pending.pop()
            try:
                dirs, files, cut = _entries(root, directory)
            except (OSError, Outside):
                continue  # (gone, unreadable or swapped for a link: skipped, as os.walk skips)
            crowded = crowded or cut
            found += [_joined(directory, f) for f in files]
            pending += reversed([_joined(directory, d) for d in dirs])
    if len(found) > MAX_LIST_ENTRIES or pending:
        return [*found[:MAX_LIST_ENTRIES], f"[truncated at {MAX_LIST_ENTRIES} entries]"]
    if crowded:
        found.append(f"[truncated: a directory has more than {MAX_DIR_ENTRIES} entries]")
    return found


def _joined(directory: str, name: str) -> str:
    return name if directory == "." else posixpath.join(directory, name)


def _entries(root: Root, directory: str) -> tuple[list[str], list[str], bool]:
    """A directory's subdirectories (not followed through a link) and its other entries, hidden
    ones skipped, each sorted; at most ``MAX_DIR_ENTRIES`` of it read, since a command can put
    millions in one (result cap, I15). True when there were more. Each directory is opened
    beneath the workspace by descriptor (I33)."""
    dirs: list[str] = []
    files: list[str] = []
    with root.scandir(directory) as scan:
        for n, entry in enumerate(scan):
            if n >= MAX_DIR_ENTRIES:
                return sorted(dirs), sorted(files), True
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                if not entry.is_symlink():
                    dirs.append(entry.name)
            else:
                files.append(entry.name)
    return sorted(dirs), sorted(files), False


class _Drain:
    """Reads one of a command's output pipes to its end in a thread of its own, keeping only the
    last ``keep`` bytes: the rest is counted and dropped as it arrives. A command may write
    without end (``yes``), so what the worker holds of it must not grow with it (result cap,
    I15), and a pipe left unread would block the command instead of letting it finish."""

    def __init__(self, pipe: IO[bytes], keep: int) -> None:
        self.keep = keep
        self.total = 0  # bytes the command wrote, the dropped ones included
        self._tail = bytearray()
        self._pipe = pipe
        self.thread = threading.Thread(target=self._run, name="charlie-command-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, _CHUNK):
                self.total += len(chunk)
                self._tail += chunk
                if len(self._tail) > self.keep:
                    del self._tail[: len(self._tail) - self.keep]
        except OSError:
            pass  # the pipe was closed under the read: what was kept stands
        finally:
            self._pipe.close()

    @property
    def truncated(self) -> bool:
        return self.total > len(self._tail)

    def text(self) -> str:
        tail = bytes(self._tail).decode(errors="replace")
        if not self.truncated:
            return tail
        return f"[{self.total - len(self._tail)} bytes cut]\n" + tail


#: how much of a pipe one read takes.
_CHUNK = 64 * 1024
#: how long the output threads are waited for once the command's group was killed (a process
#: that left the group may hold a pipe open for ever; what was read by then is the output).
_DRAIN_GRACE_SECONDS = 5.0


#: how often a running command's wait looks whether the call's lease was lost.
LEASE_CHECK_SECONDS = 0.5


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _charlie_state(s: Settings) -> tuple[Path, ...]:
    """What a command must not see: Charlie's home, every workspace root (other tasks'
    workspaces), an SQLite database kept elsewhere, and what the operator listed."""
    hidden = [s.home, *s.allowed_workspace_roots, *sandbox.hidden_from_env(s.sandbox_hide)]
    if s.is_sqlite:
        db = s.database_url.split("///", 1)[-1] if "///" in s.database_url else ""
        if db and db != ":memory:":
            hidden += [Path(db), *(Path(db + suffix) for suffix in ("-wal", "-shm", "-journal"))]
    return tuple(hidden)


@tool(effect="write", deadline=900, threadsafe=True)
def run_command(command: str, ctx: ToolContext, timeout: float = 120.0) -> JSON:
    """Run a shell command in the workspace and wait for it (up to ``timeout`` seconds).

    A non-zero exit code is a tool error the model sees, with the output."""
    # The devbox's minimal environment (PATH, HOME=the workspace, LANG): nothing else of the
    # worker's, where a database URL or a broker password may sit under any name.
    env = command_env(str(ctx.workspace), {})
    argv = ["/bin/sh", "-c", command]
    s = settings()
    if s.sandbox != "off":
        try:
            sandbox.check_mode(s.sandbox)
            policy = sandbox.SandboxPolicy(
                workspace=ctx.workspace,
                hidden=_charlie_state(s),
                readable=sandbox.paths_from_env(s.sandbox_read),
                network=sandbox.network_allowed(ctx.metadata),
                network_stack=s.sandbox_network,
                unreachable=sandbox.networks_from_env(s.sandbox_net_deny),
            )
            # the environment is set inside the sandbox; bubblewrap runs with a fixed one
            argv = sandbox.wrap(argv, policy, env=env)
        except (sandbox.SandboxUnavailable, ValueError) as exc:
            raise ToolError(str(exc)) from None
        env = dict(sandbox.BWRAP_ENV)
    proc = subprocess.Popen(
        argv,
        cwd=ctx.workspace,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a stop ends the command and its children
    )
    assert proc.stdout is not None and proc.stderr is not None
    stdout = _Drain(proc.stdout, OUTPUT_TAIL_BYTES)
    stderr = _Drain(proc.stderr, OUTPUT_TAIL_BYTES)
    deadline = time.monotonic() + timeout
    while not _finished(proc, (stdout, stderr), LEASE_CHECK_SECONDS):
        lost = ctx.lease_lost.is_set()
        if lost or time.monotonic() >= deadline:
            _kill_group(proc)
            _finished(proc, (stdout, stderr), _DRAIN_GRACE_SECONDS)
            if lost:
                # another worker took this call over: stop acting for it
                raise LeaseLost("run_command: stopped: this attempt lost the call's lease")
            raise ToolError(f"command timed out after {timeout} s", **_output(stdout, stderr))
    result: JSON = {"exit_code": proc.returncode, **_output(stdout, stderr)}
    if proc.returncode != 0:
        raise ToolError(f"command exited with code {proc.returncode}", **result)
    return result


def _finished(proc: subprocess.Popen[bytes], drains: tuple[_Drain, ...], seconds: float) -> bool:
    """Whether the command exited and its pipes reached their end (as ``communicate()`` would
    have it: a child left in the background with the pipes open is waited for too), waiting up
    to ``seconds`` for it."""
    end = time.monotonic() + seconds
    for drain in drains:
        drain.thread.join(max(0.0, end - time.monotonic()))
    try:
        proc.wait(max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return not any(drain.thread.is_alive() for drain in drains)


def _output(stdout: _Drain, stderr: _Drain) -> JSON:
    """A command's output as a result carries it: the tail of each stream, and, when any was
    cut, how much the command wrote."""
    found: JSON = {"stdout": stdout.text(), "stderr": stderr.text()}
    if stdout.truncated or stderr.truncated:
        found["truncated"] = True
        found["note"] = (
            f"output beyond the last {OUTPUT_TAIL_BYTES} bytes of each stream was dropped (the "
            f"command wrote {stdout.total} bytes to stdout and {stderr.total} to stderr)"
        )
    return found
