"""The built-in local tools, confined to the task's workspace directory.

These run in the worker process. Where a devbox is configured its tools take their place; these
stay for the no-devbox case. Commands run in a sandbox (charlie/sandbox.py) unless the operator
opted out with CHARLIE_SANDBOX=off.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

from charlie import sandbox
from charlie.config import Settings, settings
from charlie.devbox.policy import command_env
from charlie.domain import JSON
from charlie.tools.context import LeaseLost, ToolContext, ToolError
from charlie.tools.registry import tool

MAX_READ_BYTES = 200_000
OUTPUT_TAIL_BYTES = 20_000


@tool(effect="read", deadline=60, threadsafe=True)
def read_file(path: str, ctx: ToolContext) -> str:
    """Read a text file in the workspace."""
    target = ctx.resolve(path)
    if not target.is_file():
        raise ToolError(f"no such file: {path}")
    data = target.read_bytes()
    if len(data) > MAX_READ_BYTES:
        return data[:MAX_READ_BYTES].decode(errors="replace") + (
            f"\n[truncated: file is {len(data)} bytes, showing the first {MAX_READ_BYTES}]"
        )
    return data.decode(errors="replace")


@tool(effect="write", deadline=60, threadsafe=True)
def write_file(path: str, content: str, ctx: ToolContext) -> JSON:
    """Write a text file in the workspace, replacing it if it exists."""
    target = ctx.resolve(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a crash leaves the old file or the new one, never half of one. The
    # temporary name is random and created exclusively, never through a link: a command could
    # have planted a symlink at a predictable name pointing outside the workspace.
    data = content.encode()
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.charlie-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"path": path, "bytes": len(data)}


@tool(effect="read", deadline=60, threadsafe=True)
def list_files(ctx: ToolContext, path: str = ".") -> list[str]:
    """List files under a directory of the workspace (recursively, hidden entries skipped)."""
    root = ctx.resolve(path)
    if not root.is_dir():
        raise ToolError(f"no such directory: {path}")
    base = ctx.workspace.resolve()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                found.append(os.path.relpath(os.path.join(dirpath, name), base))
        if len(found) > 2000:
            found.append("[truncated at 2000 entries]")
            break
    return found


def _tail(data: bytes) -> str:
    if len(data) <= OUTPUT_TAIL_BYTES:
        return data.decode(errors="replace")
    return f"[{len(data) - OUTPUT_TAIL_BYTES} bytes cut]\n" + data[-OUTPUT_TAIL_BYTES:].decode(
        errors="replace"
    )


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
    deadline = time.monotonic() + timeout
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=min(LEASE_CHECK_SECONDS, timeout))
            break
        except subprocess.TimeoutExpired:
            lost = ctx.lease_lost.is_set()
            if lost or time.monotonic() >= deadline:
                _kill_group(proc)
                stdout, stderr = proc.communicate()
                if lost:
                    # another worker took this call over: stop acting for it (issue 12 item 5)
                    raise LeaseLost(
                        "run_command: stopped: this attempt lost the call's lease"
                    ) from None
                raise ToolError(
                    f"command timed out after {timeout} s",
                    stdout=_tail(stdout or b""),
                    stderr=_tail(stderr or b""),
                ) from None
    result: JSON = {
        "exit_code": proc.returncode,
        "stdout": _tail(stdout),
        "stderr": _tail(stderr),
    }
    if proc.returncode != 0:
        raise ToolError(f"command exited with code {proc.returncode}", **result)
    return result
