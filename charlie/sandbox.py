"""Run an agent's command in a sandbox: bubblewrap on Linux.

A command the model asked for is attacker-controlled. Without a sandbox it runs with the
worker's (or the devbox's) rights: it reads the database URL, the devbox token and model API keys
from ``/proc/$PPID/environ``, Charlie's state from its home, other tasks' workspaces, the MCP
configuration and whatever else the machine keeps, and reaches the database over loopback or a
Unix socket.

In the sandbox a command sees an ALLOW-LIST, not the machine minus a list of known secrets: an
empty root holding only

* the system's programs and libraries (``/usr`` and the ``/bin``, ``/sbin``, ``/lib*`` beside
  it), read-only;
* the few files under ``/etc`` that programs read to run (``ETC_ENTRIES``: the loader's cache,
  passwd/group, nsswitch, hosts, certificates, time zone...), never ``/etc`` as a whole;
* the toolchain that runs commands where it lives (the interpreter's prefixes, the ``PATH``),
  read-only;
* the directories the operator adds (``CHARLIE_SANDBOX_READ=/a:/b``), read-only;
* its workspace read-write, a private ``/tmp``, a fresh ``/proc`` (its own pid namespace: it
  sees only its own processes) and a minimal ``/dev``.

Anything else (``/srv``, ``/opt``, ``/var/lib``, the homes, ``/etc/charlie/mcp.json``, Charlie's
state) is simply not there. ``hidden`` paths (Charlie's home, the workspace roots, the devbox
root, ``CHARLIE_SANDBOX_HIDE``) are still replaced by empty ones where they lie inside something
the sandbox shows (a toolchain or an operator's directory).

Its environment is handed to it inside the sandbox (``--clearenv`` and ``--setenv``): bubblewrap
itself runs outside it with a fixed minimal environment (``BWRAP_ENV``), so a loader variable
(``LD_PRELOAD``...) a request carried is never loaded by the unsandboxed ``bwrap``, and such
variables are refused outright where a request may name them (``loader_variables``).

The network is off (its own empty network namespace) unless the task's policy allows it. Then the
command still gets its own network namespace, connected outwards through a user-mode network
stack (``pasta`` or ``slirp4netns``, charlie/sandbox_net.py): it reaches the outside (what lies
behind the host's gateway), but not the host's loopback (the database, the broker, the devbox,
the console), the host's own addresses, the networks the host is directly attached to (a compose
network, the LAN, where the cluster's other services live), the cloud metadata address, nor what
the operator lists in ``CHARLIE_SANDBOX_NET_DENY``. Where neither stack is installed, network
access is refused with an error naming what to install.

A command has no capabilities (``--cap-drop ALL``), in whatever user runs it: root's powers
would let it mount a filesystem (the host's disk, with Charlie's home on it), make a block
device, or delete the unreachable routes of its network namespace. It always runs in a user
namespace of its own that it cannot nest another in (``--disable-userns`` where bubblewrap has
it). As root (systemd units, many containers, CI) bubblewrap would otherwise keep root's
capabilities inside: there the command runs as ``SANDBOX_ID`` (the unprivileged ``nobody``)
inside its namespace, mapped to root's id outside, so it still owns the workspace it writes, and
what it creates there is root's for the worker to read, move and delete; everything else of the
host it sees is read-only and no capability is left to change that.

Where bubblewrap is missing (or cannot create namespaces), commands are refused unless the
operator opted out explicitly (``CHARLIE_SANDBOX=off``, ``charlie devbox serve --no-sandbox``).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: the system's programs and libraries, shown read-only (as symlinks where they are symlinks:
#: ``/bin -> usr/bin`` on a merged-/usr system).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: what programs read under /etc to run: the loader, users and groups, name resolution,
#: certificates, time zone and locale, alternatives' links, Debian's python configuration.
#: Not /etc as a whole: it holds an MCP configuration's tokens, TLS private keys, shadow files.
ETC_ENTRIES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "hosts",
    "host.conf", "gai.conf", "services", "protocols", "networks", "ssl/certs",
    "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "pki/tls/certs",
    "pki/ca-trust/extracted", "crypto-policies/back-ends", "alternatives", "localtime",
    "timezone", "locale.alias", "locale.conf", "mime.types", "magic", "magic.mime", "os-release",
    "debian_version", "lsb-release", "shells", "inputrc", "terminfo", "python3",
    "python3.9", "python3.10", "python3.11", "python3.12", "python3.13", "perl",
)  # fmt: skip
#: the network a command with network access sits on, behind the user-mode stack (slirp4netns's
#: fixed one, given to pasta too), and the name server it asks there.
SANDBOX_SUBNET = "10.0.2.0/24"
SANDBOX_NAMESERVER = "10.0.2.3"
#: scratch directories: private and empty in the sandbox.
SCRATCH_DIRS = ("/tmp", "/var/tmp")
#: credentials that tools keep in the home directory: hidden where a home is shown at all (an
#: operator's directory, a toolchain under the home).
HOME_SECRETS = (
    ".ssh", ".aws", ".azure", ".gnupg", ".kube", ".docker", ".netrc", ".pgpass",
    ".git-credentials", ".pypirc", ".config/gcloud", ".config/gh", ".config/charlie",
)  # fmt: skip
#: addresses no command reaches even with network access: the cloud metadata services.
ALWAYS_UNREACHABLE = ("169.254.169.254/32", "fd00:ec2::254/128")

#: the user and group a command runs as inside its user namespace when Charlie runs as root:
#: ``nobody``, with no capability anywhere.
SANDBOX_ID = 65534

SANDBOX_MODES = ("bwrap", "off")
#: ``auto``: pasta where it works here, else slirp4netns.
NETWORK_STACKS = ("auto", "pasta", "slirp4netns")
#: the whole environment the unsandboxed ``bwrap`` (and the network launcher) runs with.
BWRAP_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", "LANG": "C"}

#: variables the dynamic loader or libc act on before a program's own code runs (glibc's
#: "unsecure" list and the ``LD_`` family): a request may not name them (see loader_variables).
_LOADER_NAMES = frozenset(
    {
        "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
        "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
        "DYLD_INSERT_LIBRARIES", "DYLD_LIBRARY_PATH",
    }
)  # fmt: skip


class SandboxUnavailable(RuntimeError):
    """No sandbox can run here, and the operator has not opted out."""


@dataclass(frozen=True)
class SandboxPolicy:
    """What one command may see."""

    #: the only directory it may write (bound read-write at the same path).
    workspace: Path
    #: paths replaced by empty ones where they lie inside something shown (Charlie's home, the
    #: devbox root, the operator's CHARLIE_SANDBOX_HIDE).
    hidden: tuple[Path, ...] = ()
    #: whether it may reach the outside through a user-mode network stack; off by default.
    network: bool = False
    #: extra read-only directories (an operator's CHARLIE_SANDBOX_READ, a tool cache); shown
    #: even where a hidden path holds them.
    readable: tuple[Path, ...] = field(default=())
    #: paths inside the workspace the command may read but not change (a devbox checkout's
    #: ``.git/config``: the devbox's own git reads it, so a command must not plant programs in
    #: it between the devbox's check and git's read).
    frozen: tuple[Path, ...] = field(default=())
    #: the user-mode network stack for ``network``: ``auto``, ``pasta`` or ``slirp4netns``.
    network_stack: str = "auto"
    #: more networks (CIDR) a command with network access must not reach (the cluster's own
    #: services on other machines: CHARLIE_SANDBOX_NET_DENY).
    unreachable: tuple[str, ...] = field(default=())


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
                "/usr",
                "/usr",
                *_system_links(),
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--unshare-pid",
                "--unshare-net",
                *_powerless(),
                "--die-with-parent",
                "--clearenv",
                "true",
            ],
            capture_output=True,
            timeout=20,
            env=BWRAP_ENV,
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


# -- the network ------------------------------------------------------------------------------


@functools.cache
def stack_problem(stack: str) -> str | None:
    """Why ``stack`` cannot give a sandboxed command the network here (None: it can): it must
    be installed, and a sandboxed ``true`` must run behind it."""
    if shutil.which(stack, path=BWRAP_ENV["PATH"]) is None:
        package = "passt" if stack == "pasta" else stack
        return f"{stack} is not installed (Debian/Ubuntu: apt-get install {package})"
    if bwrap_problem() is not None:
        return None  # nothing runs sandboxed anyway; check_mode says why
    with tempfile.TemporaryDirectory(prefix="charlie-sandbox-probe-") as scratch:
        with_stack = SandboxPolicy(workspace=Path(scratch), network=True, network_stack=stack)
        try:
            done = subprocess.run(
                _command(["true"], with_stack, None, {}, stack),
                capture_output=True,
                timeout=30,
                env=BWRAP_ENV,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{stack} does not start: {exc}"
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        return f"{stack} cannot connect a sandbox here: {err[-1] if err else done.returncode}"
    return None


def network_stack(choice: str = "auto") -> str:
    """The user-mode network stack that gives sandboxed commands the network (``choice``:
    CHARLIE_SANDBOX_NETWORK), or SandboxUnavailable saying what to install: a command is never
    left in the host's network namespace instead."""
    if choice not in NETWORK_STACKS:
        raise SandboxUnavailable(
            f"CHARLIE_SANDBOX_NETWORK={choice!r} is not one of {', '.join(NETWORK_STACKS)}"
        )
    candidates = ("pasta", "slirp4netns") if choice == "auto" else (choice,)
    problems = []
    for stack in candidates:
        problem = stack_problem(stack)
        if problem is None:
            return stack
        problems.append(problem)
    raise SandboxUnavailable(
        "network access is refused: a sandboxed command reaches the network only through a "
        f"user-mode network stack, and none works here ({'; '.join(problems)}). Install passt "
        "(pasta) or slirp4netns (Debian/Ubuntu: apt-get install passt slirp4netns)"
    )


def network_problem(choice: str = "auto") -> str | None:
    """What ``charlie doctor`` says when no stack works (None: one does)."""
    try:
        network_stack(choice)
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def host_addresses() -> list[str]:
    """This machine's own addresses other than loopback (as /32 and /128 networks): a command
    with network access must not reach the services listening on them."""
    found: list[str] = []
    try:
        trie = Path("/proc/net/fib_trie").read_text()
    except OSError:
        trie = ""
    last = ""
    for line in trie.splitlines():
        entry = line.strip()
        if entry.startswith(("|--", "+--")):
            last = entry[3:].strip().split("/")[0]
        elif entry.startswith("/32 host LOCAL") and last:
            found.append(f"{last}/32")
    try:
        inet6 = Path("/proc/net/if_inet6").read_text()
    except OSError:
        inet6 = ""
    for line in inet6.splitlines():
        raw = line.split()[0] if line.split() else ""
        if len(raw) == 32:
            found.append(f"{ipaddress.IPv6Address(int(raw, 16))}/128")
    kept = []
    for net in found:
        address = ipaddress.ip_network(net, strict=False)
        if not address.is_loopback and net not in kept:
            kept.append(net)
    return kept


def host_networks() -> list[str]:
    """The networks this machine is directly attached to (its routes without a gateway, other
    than loopback and link-local): where a cluster's other services live (a compose network,
    the LAN), so a command with network access must not reach them. The outside is what lies
    behind a gateway. The sandbox's own subnet is left alone."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and f[0] != "lo" and int(f[2], 16) == 0 and int(f[7], 16) != 0:
                dst = ipaddress.IPv4Address(int(f[1], 16).to_bytes(4, "little"))
                mask = bin(int(f[7], 16)).count("1")
                found.append(str(ipaddress.ip_network(f"{dst}/{mask}", strict=False)))
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/ipv6_route").read_text().splitlines():
            f = line.split()
            if len(f) >= 10 and f[9] != "lo" and int(f[4], 16) == 0 and 0 < int(f[1], 16) < 128:
                net = ipaddress.ip_network(
                    f"{ipaddress.IPv6Address(int(f[0], 16))}/{int(f[1], 16)}", strict=False
                )
                if not (net.is_link_local or net.is_multicast):
                    found.append(str(net))
    own = ipaddress.ip_network(SANDBOX_SUBNET)
    kept: list[str] = []
    for raw in found:
        net = ipaddress.ip_network(raw)
        clashes = net.version == 4 and net.overlaps(own) and net.prefixlen >= own.prefixlen
        if not clashes and raw not in kept:
            kept.append(raw)
    return kept


def networks_from_env(raw: str | None) -> tuple[str, ...]:
    """``CHARLIE_SANDBOX_NET_DENY``: networks (``10.1.0.0/16``, ``192.0.2.7``, ``fd00::/8``)
    separated by commas or spaces (not ``:``, which IPv6 addresses hold)."""
    nets = []
    for item in re.split(r"[,\s]+", raw or ""):
        if item:
            nets.append(str(ipaddress.ip_network(item, strict=False)))
    return tuple(nets)


# -- the command line -------------------------------------------------------------------------


def loader_variables(env: Iterable[str]) -> list[str]:
    """The names in ``env`` that the dynamic loader or libc act on (``LD_PRELOAD``,
    ``GCONV_PATH``...): a request that names one is refused, since whatever starts the command
    would load them too."""
    return sorted(name for name in env if name.startswith("LD_") or name.upper() in _LOADER_NAMES)


def wrap(
    argv: Sequence[str],
    policy: SandboxPolicy,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """``argv`` as run inside bubblewrap under ``policy``, in ``cwd`` (default: the
    workspace).

    With ``env``, the command gets exactly that environment, set inside the sandbox; run the
    returned argv with ``env=BWRAP_ENV``. Without it (older callers), the command inherits the
    environment the argv is started with."""
    stack = network_stack(policy.network_stack) if policy.network else None
    return _command(argv, policy, cwd, env, stack)


def _command(
    argv: Sequence[str],
    policy: SandboxPolicy,
    cwd: Path | None,
    env: Mapping[str, str] | None,
    stack: str | None,
) -> list[str]:
    workspace = os.path.realpath(policy.workspace)
    args = [shutil.which("bwrap", path=BWRAP_ENV["PATH"]) or "bwrap"]
    # Its own pid namespace: when the command's group is killed, the namespace's init dies
    # with it and the kernel ends every process left inside, daemonised ones included.
    # No --die-with-parent: it fires when the *thread* that spawned bwrap ends, and
    # commands are meant to outlive the request (and the worker) that started them.
    # Always its own network namespace: empty, or connected outwards by the launcher.
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--unshare-net"]
    # No capability, as root too, in a user namespace of its own (see the module's docstring)
    args += _powerless()
    args += ["--ro-bind", "/usr", "/usr", *_system_links()]
    for entry in ETC_ENTRIES:
        source = os.path.join("/etc", entry)
        if os.path.exists(source):
            # the content, not a symlink into /run or /var that would dangle in the sandbox
            args += ["--ro-bind", os.path.realpath(source), source]
    args += ["--proc", "/proc", "--dev", "/dev"]
    for scratch in SCRATCH_DIRS:
        args += ["--tmpfs", scratch]
    shown = _shown(policy)
    for path in shown:
        args += ["--ro-bind", path, path]
    # Hidden paths inside what is shown become empty; the workspace and what was asked for
    # explicitly are bound again on top, parents before children.
    home = os.path.expanduser("~")
    secrets = [os.path.join(home, name) for name in HOME_SECRETS]
    bound = [*shown, "/usr"]
    hidden = sorted(
        {
            h
            for h in _existing([*secrets, *policy.hidden])
            if os.path.isdir(h) and h != workspace and _inside_any(h, bound)
        },
        key=len,
    )
    for h in hidden:
        args += ["--tmpfs", h]
    for f in [*secrets, *map(str, policy.hidden)]:
        real = os.path.realpath(f)
        if (
            os.path.isfile(real)
            and _inside_any(real, bound)
            and not any(real.startswith(h + "/") for h in hidden)
        ):
            args += ["--ro-bind", "/dev/null", real]
    for r in _existing([*policy.readable, *toolchain()]):
        if _inside_any(r, hidden) and r != workspace:
            args += ["--ro-bind", r, r]
    args += ["--bind", workspace, workspace]
    for frozen in policy.frozen:
        real = os.path.realpath(frozen)
        if os.path.exists(real) and real.startswith(workspace + "/"):
            args += ["--ro-bind", real, real]
    # the empty root and the directories bubblewrap made in it: read-only from here on
    args += ["--remount-ro", "/"]
    if env is not None:
        args.append("--clearenv")
        for key, value in env.items():
            args += ["--setenv", key, value]
    chdir = os.path.realpath(cwd) if cwd is not None else workspace
    args += ["--chdir", chdir, "--", *argv]
    if stack is None:
        return args
    config = {
        "stack": stack,
        "unreachable": [
            *ALWAYS_UNREACHABLE,
            *host_addresses(),
            *host_networks(),
            *policy.unreachable,
        ],
        "resolv": f"nameserver {SANDBOX_NAMESERVER}\n",
    }
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_net.py")
    # -I -S: the launcher runs with no site, no user paths, no PYTHON* variables
    return [sys.executable, "-I", "-S", launcher, json.dumps(config), *args]


def _powerless() -> list[str]:
    """bubblewrap's options that leave the command no capability: its own user namespace (as
    ``SANDBOX_ID`` where Charlie runs as root), no nested one, every capability dropped."""
    args = ["--unshare-user", "--cap-drop", "ALL"]
    if _bwrap_disables_userns():
        args.append("--disable-userns")
    if os.geteuid() == 0:
        args += ["--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID)]
    return args


@functools.cache
def _bwrap_disables_userns() -> bool:
    """Whether this bubblewrap has ``--disable-userns`` (0.8 and later)."""
    exe = shutil.which("bwrap", path=BWRAP_ENV["PATH"])
    if exe is None:
        return False
    try:
        done = subprocess.run(
            [exe, "--help"], capture_output=True, timeout=20, env=BWRAP_ENV, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--disable-userns" in done.stdout + done.stderr


def _system_links() -> list[str]:
    """``/bin``, ``/lib``... as bubblewrap options: the same symlink where the host has one
    (merged /usr), a read-only bind where it has a directory."""
    args: list[str] = []
    for path in SYSTEM_DIRS[1:]:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _shown(policy: SandboxPolicy) -> list[str]:
    """The directories shown read-only besides the system's: the toolchain and the operator's,
    by real path, parents first, none already inside another."""
    shown: list[str] = []
    for path in sorted(_existing([*toolchain(), *policy.readable]), key=len):
        if path != "/" and not _inside_any(path, [*shown, "/usr"]):
            shown.append(path)
    return shown


def _inside_any(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _existing(paths: Iterable[Path | str]) -> list[str]:
    seen: list[str] = []
    for p in paths:
        if not os.path.isabs(p):
            continue
        real = os.path.realpath(p)
        if os.path.exists(real) and real not in seen:
            seen.append(real)
    return seen


def toolchain() -> list[str]:
    """What runs commands, where it lives: the interpreter's prefixes (a virtualenv, a pyenv
    build), the directories on ``PATH``, and the root of a version manager whose shims are on
    it."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix]
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isabs(entry):
            continue
        paths.append(entry)
        # A version manager's shims (pyenv, rbenv, asdf: ``ROOT/shims``) are scripts that run
        # the manager from its root (``ROOT/libexec``, ``ROOT/versions``): a shim alone fails.
        if os.path.basename(os.path.normpath(entry)) == "shims":
            paths.append(os.path.dirname(os.path.normpath(entry)))
    return [p for p in paths if os.path.realpath(p) != "/"]


def paths_from_env(raw: str | None) -> tuple[Path, ...]:
    """A ``:``-separated list of directories (CHARLIE_SANDBOX_READ, CHARLIE_SANDBOX_HIDE)."""
    return tuple(Path(p.strip()) for p in (raw or "").split(":") if p.strip())


def hidden_from_env(raw: str | None) -> tuple[Path, ...]:
    """``CHARLIE_SANDBOX_HIDE``: more paths to hide where they lie inside something shown."""
    return paths_from_env(raw)


def network_allowed(metadata: object) -> bool:
    """A task's policy, set by its producer: ``metadata={"sandbox": {"network": true}}``."""
    policy = metadata.get("sandbox") if isinstance(metadata, dict) else None
    return isinstance(policy, dict) and policy.get("network") is True
