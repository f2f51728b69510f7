"""Fixtures for the devbox tests: real servers over real HTTP, in-process or as subprocesses."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO

import pytest

from charlie.devbox import CommandPolicy, DevboxClient, DevboxServer, Limits, RepoPolicy
from charlie.devbox.commands import proc_start_ticks
from tests.support.cluster import TEST_SANDBOX

#: at least MIN_TOKEN_LENGTH (32) characters, as the devbox requires
TOKEN = "test-devbox-token-0123456789abcdef"

ServerFactory = Callable[..., DevboxServer]


@pytest.fixture
def devbox_root(tmp_path: Path) -> Path:
    return tmp_path / "devbox"


@pytest.fixture
def make_server(devbox_root: Path) -> Iterator[ServerFactory]:
    """Start in-process devboxes on ``devbox_root``; each is stopped at teardown."""
    servers: list[DevboxServer] = []

    def make(
        policy: CommandPolicy | None = None,
        limits: Limits | None = None,
        repos: RepoPolicy | None = None,
    ) -> DevboxServer:
        limits = replace(limits or Limits(), sandbox=TEST_SANDBOX)
        # tests clone and copy from pytest's tmp dirs unless they say otherwise
        repos = repos or RepoPolicy((tempfile.gettempdir(),))
        server = DevboxServer(devbox_root, TOKEN, policy=policy, limits=limits, repos=repos).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def server(make_server: ServerFactory) -> DevboxServer:
    return make_server()


@pytest.fixture
def client(server: DevboxServer) -> Iterator[DevboxClient]:
    with DevboxClient(server.url, TOKEN) as c:
        yield c


@pytest.fixture
def workspace(client: DevboxClient) -> str:
    client.ensure_workspace("ws", None)
    return "ws"


class ServerProcess:
    """``python -m charlie.devbox serve`` as a child process, so a test can SIGKILL it."""

    def __init__(self, root: Path, log: Path, *args: str, address_space: int | None = None) -> None:
        env = {**os.environ, "CHARLIE_DEVBOX_TOKEN": TOKEN, "CHARLIE_DEVBOX_ROOT": str(root)}
        # Without bubblewrap the suite runs commands unsandboxed, as its header says; a devbox
        # would otherwise refuse to start at all (the sandbox's own tests skip instead).
        env["CHARLIE_SANDBOX"] = TEST_SANDBOX
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in kill()

        def limit() -> None:
            # RLIMIT_AS: a devbox that tries to hold more gets MemoryError, not the machine's
            if address_space is not None:
                resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "charlie.devbox", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            preexec_fn=limit if address_space is not None else None,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()  # "devbox listening on <url> root=..."
        if "listening on" not in line:
            self.kill()
            raise AssertionError(f"devbox did not start: {line!r}; see {log}")
        self.url = line.split("listening on ", 1)[1].split()[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture
def spawn_server(devbox_root: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start ``charlie.devbox serve`` processes (extra arguments passed on); stderr, the
    server's log, goes to ``tmp_path/devbox-server.log``."""
    procs: list[ServerProcess] = []

    def spawn(*args: str, address_space: int | None = None) -> ServerProcess:
        proc = ServerProcess(
            devbox_root, tmp_path / "devbox-server.log", *args, address_space=address_space
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        proc.kill()


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie awaiting its reaper counts as gone)."""
    return proc_start_ticks(pid) is None


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
