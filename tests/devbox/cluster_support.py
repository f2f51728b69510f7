"""The session's cluster pointed at a devbox, for the cluster tests of the devbox tools.

A worker's tools are the devbox's when ``CHARLIE_DEVBOX_URL``/``CHARLIE_DEVBOX_TOKEN`` are in its
environment when it starts, so a test module that needs them starts a devbox (a ``charlie devbox
serve`` subprocess on a port chosen here, so it can be SIGKILLed and started again at the same
URL), adds those variables to the cluster's settings and replaces its workers; at the end of the
module the workers are replaced again without them. The database and broker stay the session's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tests.support.cluster import TEST_SANDBOX, Cluster, free_port


class DevboxProcess:
    """``python -m charlie.devbox serve`` on a fixed port and root, restartable at the same URL."""

    def __init__(
        self,
        root: Path,
        log: Path,
        output_bytes: int = 1024 * 1024,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        #: more ``serve`` options and environment (the sandbox's tests: --allow-network,
        #: CHARLIE_SANDBOX_READ)
        self.args = args
        self.env = env or {}
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.output_bytes = output_bytes
        self._log_path = log
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        env = {
            **os.environ,
            "CHARLIE_DEVBOX_TOKEN": self.token,
            "CHARLIE_DEVBOX_ROOT": str(self.root),
            **self.env,
        }
        self._log = open(self._log_path, "ab")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "charlie.devbox",
                "serve",
                "--port",
                str(self.port),
                "--output-bytes",
                str(self.output_bytes),
                *(["--no-sandbox"] if TEST_SANDBOX == "off" else []),
                # the tests' repositories live in pytest's tmp dirs
                "--allow-repo",
                tempfile.gettempdir(),
                *self.args,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            self.kill()
            raise AssertionError(f"devbox did not start: {line!r}; see {self._log_path}")

    def kill(self) -> None:
        """SIGKILL: the devbox dies the way a machine does (its commands' watchers with it)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def workspace(self, workspace_id: str) -> Path:
        return self.root / "workspaces" / workspace_id

    def commands_in(self, workspace_id: str) -> list[str]:
        """Execution ids of every command the devbox ever started in the workspace."""
        import json

        found = []
        for meta in (self.root / "commands").glob("*/meta.json"):
            data = json.loads(meta.read_text())
            if data["workspace_id"] == workspace_id:
                found.append(data["execution_id"])
        return found

    def status_of(self, workspace_id: str) -> list[str]:
        """The status of every command the devbox ever started in the workspace."""
        import json

        return [
            data["status"]
            for data in (
                json.loads(m.read_text()) for m in (self.root / "commands").glob("*/meta.json")
            )
            if data["workspace_id"] == workspace_id
        ]


def replace_workers(cluster: Cluster) -> None:
    """Stop the cluster's workers; new ones start with ``cluster.settings_env`` as it is now."""
    old = list(cluster.workers)
    for proc in old:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # warm shutdown: the main process stops its pool
    # a short grace: anything still running belongs to an earlier module, and SIGKILL is a
    # worker death the executor recovers from anyway
    deadline = time.monotonic() + 2
    for proc in old:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    cluster.ensure(workers=2, beat=True)


@contextlib.contextmanager
def cluster_on_devbox(
    cluster: Cluster, home: Path, env: dict[str, str], output_bytes: int = 1024 * 1024
) -> Iterator[DevboxProcess]:
    devbox = DevboxProcess(home / "devbox", home / "devbox.log", output_bytes)
    saved = dict(cluster.settings_env)
    cluster.settings_env.update(
        {"CHARLIE_DEVBOX_URL": devbox.url, "CHARLIE_DEVBOX_TOKEN": devbox.token, **env}
    )
    try:
        replace_workers(cluster)
        yield devbox
    finally:
        cluster.settings_env.clear()
        cluster.settings_env.update(saved)
        replace_workers(cluster)
        devbox.kill()


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=T", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def make_repo(path: Path, files: dict[str, str]) -> str:
    """A git repository at ``path`` with ``files`` in one commit; returns the commit id."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "base")
    return git(path, "rev-parse", "HEAD")
