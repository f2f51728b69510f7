"""The built-in local tools, confined to the task's workspace directory.

These run in the worker process. Where a devbox is configured its tools take their place; these
stay for the no-devbox case. Commands run in a sandbox (charlie/sandbox.py) unless the operator
opted out with CHARLIE_SANDBOX=off.
"""

from __future__ import annotations

import os
import subprocess

from charlie import sandbox
from charlie.config import settings
from charlie.domain import JSON
from charlie.tools.context import ToolContext, ToolError
from charlie.tools.registry import tool

MAX_READ_BYTES = 200_000
OUTPUT_TAIL_BYTES = 20_000


@tool(effect="read", deadline=60)
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


@tool(effect="write", deadline=60)
def write_file(path: str, content: str, ctx: ToolContext) -> JSON:
    """Write a text file in the workspace, replacing it if it exists."""
    target = ctx.resolve(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a crash leaves the old file or the new one, never half of one.
    tmp = target.with_name(f".{target.name}.charlie-tmp")
    tmp.write_text(content)
    os.replace(tmp, target)
    return {"path": path, "bytes": len(content.encode())}


@tool(effect="read", deadline=60)
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


@tool(effect="write", deadline=900)
def run_command(command: str, ctx: ToolContext, timeout: float = 120.0) -> JSON:
    """Run a shell command in the workspace and wait for it (up to ``timeout`` seconds).

    A non-zero exit code is a tool error the model sees, with the output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHARLIE_")
        and not any(s in k.upper() for s in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
    }
    argv = ["/bin/sh", "-c", command]
    s = settings()
    if s.sandbox != "off":
        try:
            sandbox.check_mode(s.sandbox)
        except sandbox.SandboxUnavailable as exc:
            raise ToolError(str(exc)) from None
        policy = sandbox.SandboxPolicy(
            workspace=ctx.workspace,
            hidden=(s.home, *sandbox.hidden_from_env(s.sandbox_hide)),
            network=sandbox.network_allowed(ctx.metadata),
        )
        argv = sandbox.wrap(argv, policy)
    try:
        proc = subprocess.run(
            argv,
            cwd=ctx.workspace,
            env=env,
            capture_output=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        raise ToolError(
            f"command timed out after {timeout} s",
            stdout=_tail(exc.stdout or b""),
            stderr=_tail(exc.stderr or b""),
        ) from None
    result: JSON = {
        "exit_code": proc.returncode,
        "stdout": _tail(proc.stdout),
        "stderr": _tail(proc.stderr),
    }
    if proc.returncode != 0:
        raise ToolError(f"command exited with code {proc.returncode}", **result)
    return result
