"""Run an agent's command in a sandbox: bubblewrap on Linux.

A command the model asked for is attacker-controlled. Without a sandbox it runs with the
worker's (or the devbox's) rights: it reads the database URL, the devbox token and model API keys
from ``/proc/$PPID/environ``, Charlie's state from its home, other tasks' workspaces, and reaches
the database over loopback or a Unix socket. In the sandbox it has its own pid namespace (its
``/proc`` shows only its own processes), sees the machine read-only, its workspace read-write,
and empty directories where Charlie's state, other workspaces, sockets and the home directory
were; the network is off unless the task's policy allows it.

Where bubblewrap is missing (or cannot create namespaces), commands are refused unless the
operator opted out explicitly (``CHARLIE_SANDBOX=off``, ``charlie devbox serve --no-sandbox``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: where sockets (a database's, a broker's) and scratch files live: always empty in the sandbox.
ALWAYS_HIDDEN = ("/tmp", "/var/tmp", "/run", "/var/run")
#: credentials that tools keep in the home directory: hidden too. The home itself stays
#: readable (interpreters installed under it, pyenv for one, must still run).
HOME_SECRETS = (
    ".ssh", ".aws", ".azure", ".gnupg", ".kube", ".docker", ".netrc", ".pgpass",
    ".git-credentials", ".pypirc", ".config/gcloud", ".config/gh", ".config/charlie",
)  # fmt: skip

SANDBOX_MODES = ("bwrap", "off")


class SandboxUnavailable(RuntimeError):
    """No sandbox can run here, and the operator has not opted out."""


@dataclass(frozen=True)
class SandboxPolicy:
    """What one command may see."""

    #: the only directory it may write (bound read-write at the same path).
    workspace: Path
    #: directories replaced by empty ones (Charlie's home, the devbox root, the operator's list).
    hidden: tuple[Path, ...] = ()
    #: whether it keeps the host's network (loopback included); off by default.
    network: bool = False
    #: extra read-only directories bound over hidden ones (e.g. a tool cache), rarely needed.
    readable: tuple[Path, ...] = field(default=())
    #: paths inside the workspace the command may read but not change (a devbox checkout's
    #: ``.git/config``: the devbox's own git reads it, so a command must not plant programs in
    #: it between the devbox's check and git's read).
    frozen: tuple[Path, ...] = field(default=())


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a sandbox here, or None when it can."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        probe = subprocess.run(
            [
                exe,
                "--ro-bind",
                "/",
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--unshare-pid",
                "--unshare-net",
                "--die-with-parent",
                "true",
            ],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap does not start: {exc}"
    if probe.returncode != 0:
        err = probe.stderr.decode(errors="replace").strip().splitlines()
        return f"bubblewrap cannot create a sandbox here: {err[-1] if err else probe.returncode}"
    return None


def check_mode(mode: str) -> None:
    """Refuse to run commands when no sandbox is available and ``mode`` does not opt out."""
    if mode == "off":
        return
    problem = bwrap_problem()
    if problem:
        raise SandboxUnavailable(
            f"commands are refused: no sandbox ({problem}). Install bubblewrap, or opt out "
            "explicitly with CHARLIE_SANDBOX=off (or `charlie devbox serve --no-sandbox`), "
            "knowing that commands then run with this process's rights and can read its secrets"
        )


def _existing(paths: Iterable[Path | str]) -> list[str]:
    seen: list[str] = []
    for p in paths:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in seen:
            seen.append(real)
    return seen


def wrap(argv: Sequence[str], policy: SandboxPolicy, cwd: Path | None = None) -> list[str]:
    """``argv`` as run inside bubblewrap under ``policy``, in ``cwd`` (default: the
    workspace)."""
    workspace = os.path.realpath(policy.workspace)
    args = [
        shutil.which("bwrap") or "bwrap",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        # Its own pid namespace: when the command's group is killed, the namespace's init dies
        # with it and the kernel ends every process left inside, daemonised ones included.
        # No --die-with-parent: it fires when the *thread* that spawned bwrap ends, and
        # commands are meant to outlive the request (and the worker) that started them.
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    ]  # fmt: skip
    if not policy.network:
        args.append("--unshare-net")
    # Parents before children, so a directory hidden inside another stays hidden; the workspace
    # goes last, on top of whatever hid the directory it lives in.
    home = os.path.expanduser("~")
    secrets = [os.path.join(home, name) for name in HOME_SECRETS]
    hidden = sorted(
        set(_existing([*ALWAYS_HIDDEN, *secrets, *policy.hidden])) - {workspace}, key=len
    )
    for h in hidden:
        args += ["--tmpfs", h]
    for f in [*secrets, *map(str, policy.hidden)]:
        real = os.path.realpath(f)
        # a file to hide (a credential, a database outside the home), unless a hidden
        # directory already holds it
        if os.path.isfile(real) and not any(real.startswith(h + "/") for h in hidden):
            args += ["--ro-bind", "/dev/null", real]
    # What runs commands must stay reachable where it lives under a hidden directory (a
    # virtualenv in /tmp, say): the interpreter's prefixes and the PATH, read-only.
    for r in _existing([*policy.readable, *_toolchain()]):
        if any(r == h or r.startswith(h + "/") for h in hidden) and r != workspace:
            args += ["--ro-bind", r, r]
    chdir = os.path.realpath(cwd) if cwd is not None else workspace
    args += ["--bind", workspace, workspace]
    for frozen in policy.frozen:
        real = os.path.realpath(frozen)
        if os.path.exists(real) and real.startswith(workspace + "/"):
            args += ["--ro-bind", real, real]
    args += ["--chdir", chdir, "--"]
    return args + list(argv)


def _toolchain() -> list[str]:
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix]
    paths += [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    return paths


def hidden_from_env(raw: str | None) -> tuple[Path, ...]:
    """``CHARLIE_SANDBOX_HIDE``: more directories to hide, separated by ``:``."""
    return tuple(Path(p) for p in (raw or "").split(":") if p.strip())


def network_allowed(metadata: object) -> bool:
    """A task's policy, set by its producer: ``metadata={"sandbox": {"network": true}}``."""
    policy = metadata.get("sandbox") if isinstance(metadata, dict) else None
    return isinstance(policy, dict) and policy.get("network") is True
