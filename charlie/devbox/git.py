"""Running git for the devbox, safely against a workspace an agent controls.

The agent can write anything into its workspace: ``.git/config`` (with ``run_command``), files
that config includes and ``.gitattributes``. Git reads program names from configuration in many
places, so the devbox's own git (diff, commit, apply, find_commit, clone, checkout) would run
whatever the agent named, outside any sandbox its commands get. Three layers keep it from doing
so:

1. **No configuration but the repository's.** ``GIT_CONFIG_NOSYSTEM`` and
   ``GIT_CONFIG_GLOBAL=/dev/null`` drop the system and the user file (an unsandboxed command can
   write ``~/.gitconfig``), and every ``GIT_*`` variable and editor/pager/askpass variable of the
   devbox's environment is dropped, so nothing reaches git but what is set here.
2. **Command-line overrides**, which beat the repository's config and need no reading of it (so
   no race with a command rewriting it): every program-running key with a fixed name is set to a
   harmless value, and ``GIT_DIR``/``GIT_WORK_TREE`` are pinned so ``core.worktree`` cannot move
   the work tree outside the workspace. ``git diff`` also gets ``--no-ext-diff --no-textconv``.
3. **Refusal** of what no override can reach: keys named after an agent-chosen driver or URL
   (``filter.<driver>.clean``, ``merge.<driver>.driver``, ...). Before an operation that could
   honour one, the repository's config (its includes followed) is read, and any such key makes
   the operation fail with 409 naming the key and how to remove it.

4. **Confinement.** A command running at the same moment can still change what git reads
   between the check in (3) and git's read: point ``.git/commondir`` at a config of its own,
   rename ``.git`` and put a copy in its place, replace ``.git`` with a gitfile, plant
   ``info/attributes``, includes or ``config.worktree``. So on a workspace (where commands run)
   git itself runs in the commands' own bubblewrap confinement (``confine``: the devbox root and
   Charlie's state hidden, the network off, its own pid namespace, a minimal environment):
   whatever program a raced config names runs with a command's rights and no more, out of
   reach of the devbox token and of other workspaces. (1)-(3) stay, so a git outside a sandbox
   (``--no-sandbox``, where commands have the devbox's rights anyway) still runs nothing that
   is configured before the operation starts. Git before a workspace exists (clone, init, the
   first checkout, in the devbox's scratch directory that no command can see) runs unconfined:
   it needs the network and the operator's ssh credentials, and the repository's config is
   git's own fresh one.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from charlie.devbox.errors import ApiError
from charlie.devbox.policy import is_secret_name
from charlie.sandbox import BWRAP_ENV, SandboxPolicy, wrap

IDEMPOTENCY_TRAILER = "Charlie-Idempotency-Key"
#: the tree of an empty commit; diffing against it works while HEAD is unborn.
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
#: the most of git's stdout any devbox operation reads (a diff is cut well below it, at the
#: devbox's output limit); git writes what the agent's files say, so its size is theirs.
OUTPUT_BYTES = 16 * 1024 * 1024
#: the most of git's stderr that is read (its messages; the rest is dropped).
ERROR_BYTES = 64 * 1024

#: ``-c`` settings on every devbox git; command-line config wins over every config file.
_OVERRIDES: tuple[tuple[str, str], ...] = (
    ("user.name", "Charlie"),
    ("user.email", "charlie@localhost"),
    # hooks and the file-system monitor are programs the repository names
    ("core.hooksPath", os.devnull),
    ("core.fsmonitor", "false"),
    # never sign, never verify a signature (``log.showSignature`` runs gpg.program on git log)
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("log.showSignature", "false"),
    ("gpg.program", "false"),
    ("gpg.openpgp.program", "false"),
    ("gpg.x509.program", "false"),
    ("gpg.ssh.program", "false"),
    ("gpg.ssh.defaultKeyCommand", "false"),
    # ":" and "cat" are git's own spellings of "no editor" and "no pager"
    ("core.editor", ":"),
    ("sequence.editor", ":"),
    ("core.pager", "cat"),
    ("commit.verbose", "false"),
    # an empty value empties the helper list; askpass and ssh are the defaults again
    ("credential.helper", ""),
    ("core.askPass", ""),
    ("core.sshCommand", "ssh"),
    ("diff.external", ""),
    # transports: ext:: and fd:: run or reach programs; unknown ones are remote helpers
    ("protocol.allow", "never"),
    ("protocol.file.allow", "always"),
    ("protocol.git.allow", "always"),
    ("protocol.http.allow", "always"),
    ("protocol.https.allow", "always"),
    ("protocol.ssh.allow", "always"),
    ("protocol.ext.allow", "never"),
    ("protocol.fd.allow", "never"),
    # no background gc or maintenance left running after the request (and holding locks)
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
)
_CONFIG: tuple[str, ...] = tuple(arg for k, v in _OVERRIDES for arg in ("-c", f"{k}={v}"))

#: keys (lower-cased as ``git config --list`` prints them) that run a program and whose name
#: has a part the agent chooses, so no ``-c`` can override them in advance.
_REFUSED = re.compile(
    r"""
    filter\..+\.(clean|smudge|process)
    | merge\..+\.driver
    | credential\..+\.helper
    | remote\..+\.(uploadpack|receivepack|vcs)
    | trailer\..+\.(command|cmd)
    | hook\..+\.command
    | core\.(gitproxy|alternaterefscommand)
    """,
    re.VERBOSE,
)
#: git subcommands that read no work-tree content through filters and no remote, so need no
#: check of the repository's config (``log`` shows no diff here, and never a signature).
_NO_CHECK = frozenset({"rev-parse", "symbolic-ref", "log", "init", "clone", "config"})
#: the devbox environment's variables that steer git or name programs it may run.
_DROPPED_ENV = frozenset({"EDITOR", "VISUAL", "PAGER", "SSH_ASKPASS", "XDG_CONFIG_HOME"})


def git_env(cwd: Path, repo: Path | None = None, *, confined: bool = False) -> dict[str, str]:
    """The environment for devbox git: no secrets, no ``GIT_*`` but these, no config files but
    the repository's; with ``repo``, git's directory and work tree pinned to it. ``confined``
    git (on a workspace) gets only ``PATH``, ``LANG`` and ``HOME`` (the workspace) of the
    devbox's environment, as a command does: whatever a raced config makes it run sees nothing
    of the operator's."""
    if confined:
        env = {
            "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
            "LANG": os.environ.get("LANG") or "C.UTF-8",
            "HOME": str(repo or cwd),
        }
    else:
        env = {
            k: v
            for k, v in os.environ.items()
            if not is_secret_name(k) and not k.startswith("GIT_") and k not in _DROPPED_ENV
        }
    env.update(
        GIT_TERMINAL_PROMPT="0",
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_SYSTEM=os.devnull,
        # checked before core.editor / core.askPass; ":" and "" mean none
        GIT_EDITOR=":",
        GIT_SEQUENCE_EDITOR=":",
        GIT_PAGER="cat",
        GIT_ASKPASS="",
    )
    if repo is not None:
        # beats core.worktree, so a planted one cannot move the work tree out of the workspace
        env["GIT_DIR"] = str(repo / ".git")
        env["GIT_WORK_TREE"] = str(repo)
    else:
        # no walking up from a directory without a repository into one that has an agent's
        env["GIT_CEILING_DIRECTORIES"] = str(Path(os.path.realpath(cwd)).parent)
    return env


def run_git(
    args: Sequence[str],
    cwd: Path,
    *,
    timeout: float,
    confine: SandboxPolicy | None,
    input_text: str | None = None,
    check: bool = True,
    status_on_error: int = 500,
    max_output: int = OUTPUT_BYTES,
) -> Done:
    """Run ``git args`` in ``cwd``; on failure raise ApiError carrying git's own message. At
    most ``max_output`` bytes of its stdout are read (``Done.truncated`` says when there was
    more).

    ``confine``: the sandbox git runs in, which every caller names: a workspace's commands'
    confinement for git on a workspace, None only for git no command can reach (see the module
    docstring). In a repository (``cwd/.git`` exists) the repository's config is checked first,
    unless the subcommand cannot honour the refused keys.
    """
    repo = _repository(cwd)
    if repo is not None and args[0] not in _NO_CHECK:
        check_repo_config(repo, timeout, confine=confine)
    return _run(
        args,
        cwd,
        repo,
        timeout=timeout,
        confine=confine,
        input_text=input_text,
        check=check,
        status_on_error=status_on_error,
        max_output=max_output,
    )


def _repository(cwd: Path) -> Path | None:
    """``cwd`` when it holds a ``.git`` directory of its own; 409 for a symlinked ``.git``."""
    dot_git = cwd / ".git"
    if dot_git.is_symlink():
        # git would act on another repository (another workspace's) in this one's name
        raise ApiError(409, f"{dot_git} is a symlink; the devbox runs git only on its own .git")
    return cwd if dot_git.is_dir() else None


@dataclass(frozen=True)
class Done:
    """A finished git: its exit code, the first ``OUTPUT_BYTES`` (or the limit asked for) of
    its stdout, the first ``ERROR_BYTES`` of its stderr, and whether stdout was cut."""

    returncode: int
    stdout: str
    stderr: str
    truncated: bool = False


class _Head:
    """Reads a pipe to its end in a thread, keeping its first ``keep`` bytes and dropping the
    rest as it comes, so git never blocks on a full pipe and the devbox never holds more."""

    def __init__(self, pipe: IO[bytes], keep: int) -> None:
        self.keep = keep
        self.data = bytearray()
        self.truncated = False
        self._pipe = pipe
        self.thread = threading.Thread(target=self._run, name="devbox-git-output", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, 64 * 1024):
                room = self.keep - len(self.data)
                if room > 0:
                    self.data += chunk[:room]
                if len(chunk) > room:
                    self.truncated = True
        except OSError:
            pass
        finally:
            self._pipe.close()

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


def _feed(pipe: IO[bytes], data: bytes) -> None:
    # git may stop reading (a bad patch): what it read stands, and it says why
    with contextlib.suppress(OSError):
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


def _run(
    args: Sequence[str],
    cwd: Path,
    repo: Path | None,
    *,
    timeout: float,
    confine: SandboxPolicy | None,
    input_text: str | None = None,
    check: bool = True,
    status_on_error: int = 500,
    max_output: int = OUTPUT_BYTES,
) -> Done:
    if confine is not None:
        # the sandbox binds the workspace at its real path: name it (and git's dir) that way
        cwd = Path(os.path.realpath(cwd))
        repo = cwd if repo is not None else None
    cmd = ["git", "--no-pager", *_CONFIG, *args]
    env = git_env(cwd, repo, confined=confine is not None)
    if confine is not None:
        # git's environment is set inside the sandbox; bubblewrap itself gets a fixed minimal one
        cmd, env = wrap(cmd, confine, cwd, env=env), dict(BWRAP_ENV)
    try:
        # its own process group, so a timeout ends git and whatever it started (a filter, ssh)
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
    except FileNotFoundError:
        what = "bubblewrap" if confine is not None else "git"
        raise ApiError(500, f"{what} is not installed on the devbox") from None
    assert proc.stdout is not None and proc.stderr is not None
    # at most max_output bytes of stdout are kept; the rest is read and dropped so git ends
    out, err = _Head(proc.stdout, max_output), _Head(proc.stderr, ERROR_BYTES)
    if input_text is not None:
        assert proc.stdin is not None
        feeding = threading.Thread(
            target=_feed, args=(proc.stdin, input_text.encode()), daemon=True
        )
        feeding.start()
    end = time.monotonic() + timeout
    try:
        proc.wait(timeout)
        for reader in (out, err):
            reader.thread.join(max(0.0, end - time.monotonic()))
            if reader.thread.is_alive():
                raise subprocess.TimeoutExpired(cmd, timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ApiError(504, f"git {args[0]} took longer than {timeout:g}s") from None
    except BaseException:
        _kill_group(proc)
        raise
    done = Done(proc.returncode, out.text(), err.text(), out.truncated)
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise ApiError(status_on_error, f"git {args[0]} failed: {detail}")
    return done


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL git's process group (in a sandbox, its pid namespace dies with its first
    process, taking along anything that left the group) and reap it (its output's readers
    drain what is left)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def check_repo_config(repo: Path, timeout: float, *, confine: SandboxPolicy | None) -> None:
    """409 if the repository's config (includes followed) sets a key git would run a program
    from and no override can neutralize; reading config runs nothing."""
    done = _run(
        ["config", "--list", "--includes", "--show-scope", "--show-origin", "-z"],
        repo,
        repo,
        timeout=timeout,
        confine=confine,
        check=False,
    )
    if done.returncode != 0:
        detail = done.stderr.strip() or f"exit code {done.returncode}"
        raise ApiError(409, f"cannot read the workspace's git config: {detail}")
    if done.truncated:
        # a key past the cut could not be checked: none is trusted
        raise ApiError(
            409, f"the workspace's git config lists more than {OUTPUT_BYTES} bytes; shorten it"
        )
    # -z records: scope NUL origin NUL key LF value NUL
    fields = done.stdout.split("\x00")
    found: list[str] = []
    for i in range(0, len(fields) - 2, 3):
        scope, origin, entry = fields[i], fields[i + 1], fields[i + 2]
        key = entry.split("\n", 1)[0]
        if scope != "command" and _REFUSED.fullmatch(key):
            found.append(f"{key} (from {origin.removeprefix('file:')})")
    if found:
        keys = " ".join(sorted({f.split(" ", 1)[0] for f in found}))
        raise ApiError(
            409,
            "the workspace's git config sets a key that makes git run a program, which the "
            f"devbox's own git never does: {'; '.join(found)}. Remove it "
            f"(git config --unset-all <key>, for each of: {keys}) and retry.",
        )


def head(cwd: Path, timeout: float, *, confine: SandboxPolicy | None) -> str | None:
    """HEAD's commit, or None while the branch is unborn (a fresh clone of an empty repo)."""
    done = run_git(
        ["rev-parse", "--verify", "-q", "HEAD"], cwd, timeout=timeout, confine=confine, check=False
    )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def current_branch(cwd: Path, timeout: float, *, confine: SandboxPolicy | None) -> str | None:
    """The checked-out branch, or None on a detached HEAD."""
    done = run_git(
        ["symbolic-ref", "-q", "--short", "HEAD"],
        cwd,
        timeout=timeout,
        confine=confine,
        check=False,
    )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def find_commit(
    cwd: Path, key: str, timeout: float, *, confine: SandboxPolicy | None
) -> str | None:
    """The newest commit in HEAD's history whose idempotency trailer is exactly ``key``.

    ``--grep`` narrows the walk cheaply; the trailer is then compared exactly, so a key that is a
    prefix of another never matches it.
    """
    if head(cwd, timeout, confine=confine) is None:
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
        confine=confine,
    )
    if done.truncated:
        # the commit sought may be past the cut: saying "none" could commit twice
        raise ApiError(
            409, f"more than {OUTPUT_BYTES} bytes of commits carry an idempotency trailer"
        )
    for record in done.stdout.split("\x00"):
        lines = record.strip("\n").split("\n")
        if lines and lines[0] and key in (value.strip() for value in lines[1:]):
            return lines[0]
    return None


def commit_message(message: str, key: str) -> str:
    """The message with the idempotency key as a trailer in its own final paragraph."""
    return f"{message.rstrip()}\n\n{IDEMPOTENCY_TRAILER}: {key}\n"
