"""Running git for the devbox, safely against a workspace an agent controls.

The agent can write anything into a workspace, including ``.git/config`` and ``.git/hooks``.
Git run by the devbox therefore disables hooks, fsmonitor and external diff drivers (each would
run agent-chosen programs) and runs with a scrubbed environment, so even a program git does run
sees none of the devbox's secrets.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from charlie.devbox.errors import ApiError
from charlie.devbox.policy import is_secret_name

IDEMPOTENCY_TRAILER = "Charlie-Idempotency-Key"
#: the tree of an empty commit; diffing against it works while HEAD is unborn.
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

_CONFIG = (
    "-c",
    "user.name=Charlie",
    "-c",
    "user.email=charlie@localhost",
    "-c",
    "commit.gpgsign=false",
    "-c",
    f"core.hooksPath={os.devnull}",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "protocol.ext.allow=never",
)


def git_env() -> dict[str, str]:
    """The devbox's environment without secret-looking names, and never prompting."""
    env = {k: v for k, v in os.environ.items() if not is_secret_name(k)}
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def run_git(
    args: Sequence[str],
    cwd: Path,
    *,
    timeout: float,
    input_text: str | None = None,
    check: bool = True,
    status_on_error: int = 500,
) -> subprocess.CompletedProcess[str]:
    """Run ``git args`` in ``cwd``; on failure raise ApiError carrying git's own message."""
    cmd = ["git", *_CONFIG, *args]
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=git_env(),
            input=input_text,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ApiError(504, f"git {args[0]} took longer than {timeout:g}s") from None
    except FileNotFoundError:
        raise ApiError(500, "git is not installed on the devbox") from None
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise ApiError(status_on_error, f"git {args[0]} failed: {detail}")
    return done


def head(cwd: Path, timeout: float) -> str | None:
    """HEAD's commit, or None while the branch is unborn (a fresh clone of an empty repo)."""
    done = run_git(["rev-parse", "--verify", "-q", "HEAD"], cwd, timeout=timeout, check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def current_branch(cwd: Path, timeout: float) -> str | None:
    """The checked-out branch, or None on a detached HEAD."""
    done = run_git(["symbolic-ref", "-q", "--short", "HEAD"], cwd, timeout=timeout, check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def find_commit(cwd: Path, key: str, timeout: float) -> str | None:
    """The newest commit in HEAD's history whose idempotency trailer is exactly ``key``.

    ``--grep`` narrows the walk cheaply; the trailer is then compared exactly, so a key that is a
    prefix of another never matches it.
    """
    if head(cwd, timeout) is None:
        return None
    done = run_git(
        [
            "log",
            "-z",
            "--fixed-strings",
            f"--grep={IDEMPOTENCY_TRAILER}: {key}",
            f"--format=%H%n%(trailers:key={IDEMPOTENCY_TRAILER},valueonly)",
            "HEAD",
        ],
        cwd,
        timeout=timeout,
    )
    for record in done.stdout.split("\x00"):
        lines = record.strip("\n").split("\n")
        if lines and lines[0] and key in (value.strip() for value in lines[1:]):
            return lines[0]
    return None


def commit_message(message: str, key: str) -> str:
    """The message with the idempotency key as a trailer in its own final paragraph."""
    return f"{message.rstrip()}\n\n{IDEMPOTENCY_TRAILER}: {key}\n"
