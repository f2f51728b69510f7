"""What the devbox lets a command do: which programs may run, with which environment, how long
and how much output; and how large a workspace may grow.

The policy is a guard rail against an agent's obvious mistakes, not a sandbox: commands run as
the devbox's own user, and a determined shell string can always reach a denied program
(``eval``, ``$(...)``, an interpreter). Isolation belongs to the machine or container the devbox
runs in.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from charlie.devbox.errors import ApiError
from charlie.sandbox import loader_variables

MIB = 1024 * 1024

#: programs refused unless the operator configures otherwise: they change the machine or the
#: user, which no agent task should do.
DEFAULT_DENY: tuple[str, ...] = (
    "sudo",
    "su",
    "doas",
    "shutdown",
    "reboot",
    "halt",
    "poweroff",
    "mkfs",
)

#: words after which the shell expects another command name (``if make; then sudo ...``).
_SHELL_PREFIX_WORDS = frozenset({"if", "then", "else", "elif", "do", "while", "until", "!", "{"})
#: reserved words that are not programs and after which no command name follows directly.
_SHELL_OTHER_WORDS = frozenset({"fi", "done", "esac", "}", "for", "case", "select", "in"})
#: programs that run their arguments as another program, so that program is checked too.
_WRAPPERS = frozenset({"env", "exec", "nohup", "command", "nice", "timeout", "time", "xargs"})
#: sudo-like wrappers are denied themselves by default, but if allowed they still wrap.
_WRAPPERS_ALSO = frozenset({"sudo", "doas", "stdbuf", "setsid"})
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


@dataclass(frozen=True)
class Limits:
    """Resource limits the devbox enforces on every workspace and command."""

    #: each of a command's stdout and stderr is kept up to this many bytes; the rest is dropped.
    output_bytes: int = MIB
    #: the longest a command may run; a request may ask for less, never more.
    command_timeout: float = 600.0
    #: a workspace (its .git included) may not grow past this through file writes and patches.
    workspace_bytes: int = 200 * MIB
    #: the largest file read_file returns.
    read_bytes: int = MIB
    #: the most entries of one directory list_files reads and returns (it says truncated).
    list_entries: int = 10_000
    #: the largest JSON request body accepted.
    request_bytes: int = 64 * MIB
    #: how long a git operation (clone, commit, diff) may take.
    git_timeout: float = 300.0
    #: ``bwrap``: every command runs in bubblewrap, and none runs where it cannot; ``off``: the
    #: operator's explicit opt-out (``--no-sandbox``).
    sandbox: str = "bwrap"
    #: whether a command may keep the network when its request asks for it (``--allow-network``).
    allow_network: bool = False
    #: more paths commands must not see besides the devbox root (Charlie's home and database
    #: when the devbox runs beside a worker, CHARLIE_SANDBOX_HIDE).
    hidden: tuple[Path, ...] = ()
    #: directories commands may read besides the sandbox's allow-list (CHARLIE_SANDBOX_READ).
    readable: tuple[Path, ...] = ()
    #: the user-mode network stack for commands given the network (CHARLIE_SANDBOX_NETWORK).
    network_stack: str = "auto"
    #: networks such commands must not reach besides the host's own addresses
    #: (CHARLIE_SANDBOX_NET_DENY).
    unreachable: tuple[str, ...] = ()
    #: the longest a connection may wait for one read or write: an idle keep-alive
    #: connection, or a client gone quiet mid-request, is closed after this.
    http_idle_seconds: float = 30.0
    #: the longest a client may take to send a whole request (line, headers and body), so one
    #: that trickles bytes just inside the idle timeout (slowloris) is still cut off.
    http_request_seconds: float = 120.0
    #: connections served at once; more are closed at accept, so a flood cannot exhaust threads.
    http_connections: int = 64


@dataclass(frozen=True)
class CommandPolicy:
    """Which programs may run, matched on the basename of each command word.

    ``allow=None`` allows everything not denied; a list allows only those names. ``deny`` always
    wins.
    """

    allow: list[str] | None = None
    deny: list[str] = field(default_factory=lambda: list(DEFAULT_DENY))

    def check(self, names: Iterable[str]) -> None:
        """Raise 403 naming the first program the policy refuses."""
        deny = set(self.deny)
        allow = None if self.allow is None else set(self.allow)
        for raw in names:
            name = os.path.basename(raw)
            if name in deny:
                raise ApiError(403, f"command {name!r} is denied by the devbox policy")
            if allow is not None and name not in allow:
                raise ApiError(403, f"command {name!r} is not in the devbox allow list")


def argv_command_names(argv: Sequence[str]) -> list[str]:
    """The programs an argv runs: argv[0], and what a wrapper like ``env`` or ``nohup`` runs."""
    return _command_names(list(argv), shell=False)


def shell_command_names(shell: str) -> list[str]:
    """The programs a shell string runs, as far as a lexer can tell without executing it.

    Newlines count as command separators even inside quotes: that may check a quoted word as a
    program, which errs on the side of refusing.
    """
    lexer = shlex.shlex(shell.replace("\n", " ; "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise ApiError(400, f"cannot parse shell command: {exc}") from exc
    return _command_names(tokens, shell=True)


def _command_names(tokens: list[str], *, shell: bool) -> list[str]:
    names: list[str] = []
    expect_command = True
    in_wrapper = False
    skip_target = False
    for token in tokens:
        if shell and token and set(token) <= set("();&|<>"):
            if set(token) & set("<>"):
                skip_target = True  # a redirection: the next word is a file, not a program
            else:
                expect_command, in_wrapper = True, False  # a separator starts a new command
            continue
        if skip_target:
            skip_target = False
            continue
        if not expect_command or (shell and token in _SHELL_PREFIX_WORDS):
            continue
        if shell and token in _SHELL_OTHER_WORDS:
            expect_command = False
            continue
        if _ASSIGNMENT.match(token) or (in_wrapper and _is_wrapper_argument(token)):
            continue
        names.append(token)
        in_wrapper = os.path.basename(token) in _WRAPPERS | _WRAPPERS_ALSO
        expect_command = in_wrapper
    return names


def _is_wrapper_argument(token: str) -> bool:
    """Options and durations a wrapper takes before the program it runs (``timeout -s 9 5``)."""
    return token.startswith("-") or token.replace(".", "", 1).rstrip("smhd").isdigit()


def is_secret_name(name: str) -> bool:
    """True for environment names the devbox never hands from its own environment to a command."""
    upper = name.upper()
    return upper.startswith("CHARLIE_") or any(marker in upper for marker in _SECRET_MARKERS)


def command_env(workspace: str, requested: Mapping[str, str]) -> dict[str, str]:
    """A minimal environment for a command: PATH, HOME=workspace and LANG from the devbox, plus
    what the request asked for. Nothing else of the devbox's environment (where its token and
    any credentials live) reaches the command.
    """
    env = {
        "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
        "HOME": workspace,
        "LANG": os.environ.get("LANG") or "C.UTF-8",
        "GIT_TERMINAL_PROMPT": "0",
    }
    env = {k: v for k, v in env.items() if not is_secret_name(k)}
    env.update(requested)
    return env


def validate_env(raw: object) -> dict[str, str]:
    """The request's ``env`` as a str->str mapping, or 400."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ApiError(400, "env must be an object of string values")
    env: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ApiError(400, f"env name {key!r} is not a valid variable name")
        if not isinstance(value, str) or "\x00" in value:
            raise ApiError(400, f"env value for {key!r} must be a string without NUL")
        env[key] = value
    refused = loader_variables(env)
    if refused:
        raise ApiError(
            400,
            f"env may not set {', '.join(refused)}: the dynamic loader acts on these before the "
            "command's own code runs; set them inside the command instead "
            "(e.g. `LD_LIBRARY_PATH=... program` in a shell command)",
        )
    return env


#: ``host:path`` (git's scp-like ssh syntax) or ``scheme://...``; anything else is a local path.
_URL_LIKE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|[^/:]+:)")


def is_url(source: str) -> bool:
    return bool(_URL_LIKE.match(source))


@dataclass(frozen=True)
class RepoPolicy:
    """Where workspaces may come from (``charlie devbox serve --allow-repo``, repeatable).

    Each entry is a local directory, or a glob of one (``/srv/git/*.git``), or a URL pattern
    (``https://github.com/acme/*``, ``git@github.com:acme/*``). A local ``repo`` or a
    ``copy_from`` is allowed when its real path (symlinks resolved) is an allowed directory or
    lies inside one, or matches an allowed glob; a URL when it matches a URL pattern and names
    no ``..`` segment. Nothing is allowed by default, except an empty workspace (``repo``
    null)."""

    allow: tuple[str, ...] = ()

    def check_repo(self, repo: str) -> None:
        if is_url(repo):
            if self._url_allowed(repo):
                return
            what = f"repository URL {repo!r}"
        else:
            if self._path_allowed(repo):
                return
            what = f"repository {repo!r}"
        raise ApiError(403, self._refusal(what))

    def check_copy_from(self, path: str) -> None:
        if not is_url(path) and self._path_allowed(path):
            return
        raise ApiError(403, self._refusal(f"copy_from {path!r}"))

    def _path_allowed(self, raw: str) -> bool:
        real = os.path.realpath(raw)
        for entry in self.allow:
            if is_url(entry):
                continue
            if any(ch in entry for ch in "*?["):
                if fnmatch.fnmatchcase(real, os.path.abspath(entry)):
                    return True
                continue
            root = os.path.realpath(entry)
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return True
        return False

    def _url_allowed(self, url: str) -> bool:
        if any(ch.isspace() or ord(ch) < 32 for ch in url):
            return False
        if ".." in re.split(r"[/:\\]", url.split("?", 1)[0]) or "%2e" in url.lower():
            return False
        return any(is_url(entry) and fnmatch.fnmatchcase(url, entry) for entry in self.allow)

    def _refusal(self, what: str) -> str:
        allowed = ", ".join(self.allow) if self.allow else "none"
        return (
            f"{what} is not allowed on this devbox: workspaces come only from the roots and URL "
            f"patterns its operator allows (charlie devbox serve --allow-repo; allowed: {allowed})"
        )
