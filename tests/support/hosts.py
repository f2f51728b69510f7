"""Other hosts for tests: network namespaces on veth pairs, and the services reached over them.

Each "host" is a network namespace of its own, joined to this machine by a veth pair on a /24
of 10.231.N.0 that nothing else here routes (this side .1, the namespace .2). A process started
in it (``ip netns exec``) sees the host only at that address, so the database and the broker,
which listen on 127.0.0.1 alone, are reached through a TCP forwarder listening on this side's
address of each pair: a connection over a real link that a test can cut (``partition``: this
side of the pair down, so packets in both directions are dropped silently, as on a pulled
cable) and bring back. Only addresses these pairs create are used.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

#: every interface and namespace made here starts with this (and is removed in teardown)
PREFIX = "chh"


def netns_problem() -> str | None:
    """Why namespaces and veth pairs cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "making network namespaces and veth pairs needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing: apt-get install iproute2"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One namespace: its name, the interface on this side, and both ends' addresses."""

    netns: str
    link: str
    here: str  # this side's address: where the host's services are reached from the namespace
    there: str  # the namespace's own address

    def command(self) -> list[str]:
        """The prefix that runs a command in the namespace."""
        return ["ip", "netns", "exec", self.netns]

    def partition(self) -> None:
        """Cut the link: nothing gets through either way, and nobody is told."""
        _ip("link", "set", self.link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.link, "up")


def _free_subnets(count: int) -> list[int]:
    taken = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    taken += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    free = [n for n in random.sample(range(1, 255), 254) if f"10.231.{n}." not in taken]
    if len(free) < count:
        raise RuntimeError("no free 10.231.N.0/24 subnet for a test namespace")
    return free[:count]


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` namespaces, each on a veth pair of its own; all removed on exit."""
    tag = secrets.token_hex(2)
    made: list[Host] = []
    try:
        for i, n in enumerate(_free_subnets(count)):
            host = Host(
                f"{PREFIX}{tag}n{i}", f"{PREFIX}{tag}h{i}", f"10.231.{n}.1", f"10.231.{n}.2"
            )
            peer = f"{PREFIX}{tag}p{i}"
            _ip("netns", "add", host.netns)
            made.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("addr", "add", f"{host.here}/24", "dev", host.link)
            _ip("link", "set", host.link, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.there}/24", "dev", peer)
            _ip("-n", host.netns, "link", "set", peer, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", host.link)  # (takes its peer with it)
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", host.netns)


@dataclass
class Forwarder:
    """Relays connections made to ``listen`` (address, port 0: any) to ``target``, one thread
    per direction per connection, until closed. Stands for a service listening on a network
    address, where the real one listens on loopback only."""

    listen: tuple[str, int]
    target: tuple[str, int]
    _server: socket.socket = field(init=False)
    _open: set[socket.socket] = field(default_factory=set, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _closed: bool = field(default=False, init=False)

    def start(self) -> Forwarder:
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(self.listen)
        self._server.listen(64)
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, 10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._open)
        with contextlib.suppress(OSError):
            self._server.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def moved(url: str, host: str, port: int) -> str:
    """``url`` with its host and port replaced (user, password, path and query kept)."""
    parts = urlsplit(url)
    credentials, _, _ = parts.netloc.rpartition("@")
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def endpoint(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


__all__ = ["Forwarder", "Host", "endpoint", "hosts", "moved", "netns_problem"]
