"""Give a sandboxed command the network without the host's: run as a script, never imported.

``python -I -S sandbox_net.py CONFIG BWRAP_ARGV...``, as charlie/sandbox.py builds it. It starts
bubblewrap (whose argv already unshares the network) held before the command runs, and then:

1. adds ``unreachable`` routes inside the command's network namespace for the host's own
   addresses and directly attached networks, the cloud metadata address and the operator's
   list (a user-mode stack opens its sockets on the host, so without them a connection to the
   host's address, or to a neighbour's on its network, would reach a service there);
2. connects the namespace outwards through the user-mode stack, told never to map the host's
   loopback into it: ``slirp4netns --disable-host-loopback``, or ``pasta`` with ``--no-map-gw``
   and no port forwarding in either direction (``-t none -u none -T none -U none``);
3. hands the command a ``/etc/resolv.conf`` naming the stack's DNS forwarder, lets it run, and
   exits with its status, stopping the stack.

It uses only the standard library (it runs with ``-I -S``, before anything of Charlie's), runs
with bubblewrap's fixed minimal environment, and stays in the command's process group, so the
group's SIGKILL ends the stack with the command.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time
from typing import IO, Any

SETUP_SECONDS = 20.0
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NS_GET_USERNS = 0xB701  # ioctl_ns(2)
# netlink: add a route (rtnetlink(7))
RTM_NEWROUTE = 24
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
RT_TABLE_MAIN, RTPROT_STATIC, RT_SCOPE_UNIVERSE, RTN_UNREACHABLE, RTA_DST = 254, 4, 0, 7, 1


class SetupError(RuntimeError):
    pass


def main(argv: list[str]) -> int:
    config: dict[str, Any] = json.loads(argv[0])
    bwrap = argv[1:]
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    resolv_r, resolv_w = os.pipe()
    # right after bubblewrap's name: nothing of the command's (its environment, its argv) can
    # be mistaken for where options end; /etc/resolv.conf is bound nowhere else
    bwrap = [
        bwrap[0],
        "--info-fd", str(info_w), "--block-fd", str(block_r),
        "--ro-bind-data", str(resolv_r), "/etc/resolv.conf",
        *bwrap[1:],
    ]  # fmt: skip
    child = subprocess.Popen(bwrap, pass_fds=(info_w, block_r, resolv_r))
    for fd in (info_w, block_r, resolv_r):
        os.close(fd)
    os.write(resolv_w, str(config["resolv"]).encode())
    os.close(resolv_w)
    stack: subprocess.Popen[bytes] | None = None
    # what a stack says, read only when it fails (memory, not a file anywhere)
    with os.fdopen(os.memfd_create("charlie-sandbox-net"), "w+b") as log:
        try:
            pid = _child_pid(info_r)
            if pid is None:
                return _status(child.wait())  # bubblewrap failed before the command: it said why
            # bubblewrap brings the namespace's loopback up itself, over netlink: nothing else
            # may talk netlink in the namespace before it is done
            _wait_loopback(pid)
            _add_unreachable(pid, [str(n) for n in config["unreachable"]])
            stack = _start_stack(str(config["stack"]), pid, log)
        except (SetupError, OSError) as exc:
            log.seek(0)
            detail = log.read().decode(errors="replace").strip().splitlines()
            sys.stderr.write(
                f"charlie sandbox: no network for this command: {exc}"
                + (f" ({detail[-1]})" if detail else "")
                + "\n"
            )
            _stop(child)
            if stack is not None:
                _stop(stack)
            return 125
    os.write(block_w, b"1")  # the command may run now
    os.close(block_w)
    code = child.wait()
    _stop(stack)
    return _status(code)


def _child_pid(info_r: int) -> int | None:
    """The command's pid (outside its pid namespace), from bubblewrap's --info-fd."""
    data = b""
    deadline = time.monotonic() + SETUP_SECONDS
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(info_r, 4096)
        if not chunk:
            return None
        data += chunk
        with contextlib.suppress(ValueError):
            return int(json.loads(data)["child-pid"])
    raise SetupError("bubblewrap did not report the command's pid")


def _wait_loopback(pid: int) -> None:
    deadline = time.monotonic() + SETUP_SECONDS
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/net/fib_trie") as trie:
                text = trie.read()
        except OSError as exc:
            raise SetupError(f"the command's namespace is gone: {exc}") from exc
        if "127.0.0.1" in text and "host LOCAL" in text:
            return
        time.sleep(0.002)
    raise SetupError("bubblewrap did not bring the namespace's loopback up")


def _netns_owner(pid: int) -> int:
    """An fd of the user namespace that owns the command's network namespace."""
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        return int(fcntl.ioctl(net, NS_GET_USERNS))
    finally:
        os.close(net)


def _own_userns(pid: int) -> bool:
    return os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino


def _add_unreachable(pid: int, networks: list[str]) -> None:
    """Route each network to nowhere inside the command's namespace (a forked child joins it:
    joining a user namespace cannot be undone)."""
    if not networks:
        return
    forked = os.fork()
    if forked == 0:
        code = 0
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            kinds = [("net", CLONE_NEWNET, os.open(f"/proc/{pid}/ns/net", os.O_RDONLY))]
            if not _own_userns(pid):
                kinds.insert(0, ("user", CLONE_NEWUSER, _netns_owner(pid)))
            for name, kind, fd in kinds:
                if libc.setns(fd, kind) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"cannot join the command's {name} namespace")
                os.close(fd)
            _routes(networks)
        except BaseException as exc:  # report and leave: this is a forked copy
            sys.stderr.write(f"charlie sandbox: {exc}\n")
            code = 1
        os._exit(code)
    _, status = os.waitpid(forked, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SetupError("cannot route the host's addresses to nowhere in the namespace")


def _routes(networks: list[str]) -> None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as nl:  # NETLINK_ROUTE
        for seq, raw in enumerate(networks, start=1):
            net = ipaddress.ip_network(raw, strict=False)
            family = socket.AF_INET if net.version == 4 else socket.AF_INET6
            dst = net.network_address.packed
            attr = struct.pack("=HH", 4 + len(dst), RTA_DST) + dst
            body = struct.pack(
                "=BBBBBBBBI", family, net.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC,
                RT_SCOPE_UNIVERSE, RTN_UNREACHABLE, 0,
            )  # fmt: skip
            flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
            msg = body + attr
            nl.send(struct.pack("=IHHII", 16 + len(msg), RTM_NEWROUTE, flags, seq, 0) + msg)
            reply = nl.recv(65536)
            _, kind, _, _, _ = struct.unpack("=IHHII", reply[:16])
            error = struct.unpack("=i", reply[16:20])[0] if kind == NLMSG_ERROR else 0
            if error and not (net.version == 6 and -error == 97):  # EAFNOSUPPORT: no IPv6
                raise OSError(-error, f"cannot add an unreachable route for {net}")


def _start_stack(stack: str, pid: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    if stack == "slirp4netns":
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        argv = [
            "slirp4netns", "--configure", "--mtu=65520", "--disable-host-loopback",
            f"--ready-fd={ready_w}", f"--exit-fd={exit_r}",
        ]  # fmt: skip
        keep = [ready_w, exit_r]
        if _own_userns(pid):
            # its own sandbox (an empty root, fewer capabilities): where it may make one
            argv.append("--enable-sandbox")
        else:
            # bubblewrap's command sits in a user namespace nested in the one that owns its
            # network namespace: slirp4netns must join the owner
            owner = _netns_owner(pid)
            keep.append(owner)
            argv.append(f"--userns-path=/proc/self/fd/{owner}")
        proc = subprocess.Popen(
            [*argv, str(pid), "tap0"],
            pass_fds=keep,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        for fd in keep[2:]:
            os.close(fd)
        os.close(ready_w)
        os.close(exit_r)
        # the launcher holds the write end: slirp4netns stops when it is closed, at the end
        # or when the group's SIGKILL ends the launcher
        proc.exit_fd = exit_w  # type: ignore[attr-defined]
        ready, _, _ = select.select([ready_r], [], [], SETUP_SECONDS)
        ok = bool(ready) and os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        if not ok:
            _stop(proc)
            raise SetupError("slirp4netns did not connect the namespace")
        return proc
    argv = [
        "pasta", "--foreground", "--quiet", "--config-net", "--no-map-gw",
        "-t", "none", "-u", "none", "-T", "none", "-U", "none",
        # slirp4netns's addressing, not a copy of the host's: the host's own subnets stay
        # routable to nowhere inside; IPv4 only, as with slirp4netns
        "--ipv4-only", "-a", "10.0.2.100", "-n", "24", "-g", "10.0.2.2",
        "--dns-forward", "10.0.2.3",
    ]  # fmt: skip
    preexec = None
    keep = []
    if os.geteuid() == 0 and _own_userns(pid):
        # As root, pasta cannot open /proc/PID/ns/* once it has dropped its privileges: it
        # is given the namespace as a file instead, bound in a mount namespace of its own
        # (which vanishes with it, so nothing is left mounted whatever ends it).
        argv += ["--runas", "0", "--netns", _PASTA_NETNS]

        def preexec() -> None:
            _bind_netns(pid)

    else:
        # the user namespace that owns the network namespace (bubblewrap's command sits in
        # one nested in it)
        owner = _netns_owner(pid)
        keep.append(owner)
        if os.geteuid() == 0:
            # the command's own user namespace (Charlie runs as root: sandbox.py makes one) is
            # root's: pasta may enter it only as root, not as the ``nobody`` it would become
            argv += ["--runas", "0"]
        argv += ["--userns", f"/proc/self/fd/{owner}", "--netns", f"/proc/{pid}/ns/net"]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        preexec_fn=preexec,
        pass_fds=keep,
    )
    for fd in keep:
        os.close(fd)
    deadline = time.monotonic() + SETUP_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SetupError(f"pasta stopped with status {proc.returncode}")
        if _has_default_route(pid):
            return proc
        time.sleep(0.01)
    _stop(proc)
    raise SetupError("pasta did not connect the namespace")


#: where pasta, as root, finds the command's network namespace (in its own mount namespace)
_PASTA_NETNS = "/tmp/charlie-sandbox-netns"
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
CLONE_NEWNS = 0x00020000


def _bind_netns(pid: int) -> None:
    """In pasta's process before it starts: a private mount namespace, a tmpfs on /tmp and the
    command's network namespace bound on a file there."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"pasta's namespace file: {what}")

    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"mode=0700"), "tmpfs on /tmp")
    os.close(os.open(_PASTA_NETNS, os.O_CREAT | os.O_WRONLY, 0o600))
    source = f"/proc/{pid}/ns/net".encode()
    check(libc.mount(source, _PASTA_NETNS.encode(), None, MS_BIND, None), "bind")


def _has_default_route(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/net/route") as routes:
            return any(line.split()[1:2] == ["00000000"] for line in routes.readlines()[1:])
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    exit_fd = getattr(proc, "exit_fd", None)
    if exit_fd is not None:
        with contextlib.suppress(OSError):
            os.close(exit_fd)
    # a stack keeps no state worth a clean stop, and bubblewrap held back is only waiting
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
