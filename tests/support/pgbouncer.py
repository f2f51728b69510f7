"""A PgBouncer of a test's (or CI's) own in front of the shared PostgreSQL, in transaction
pooling mode: its config in a temporary directory, its own port, trust auth.

PgBouncer refuses to run as root; started by root, it drops to ``nobody`` (``-u``), which must
be able to read the config, so the directory is made world-readable (it holds no secret).

Used by tests (``PgBouncer(...).start()``) and by ``.ci/run``::

    python -m tests.support.pgbouncer --port 6433 --upstream 127.0.0.1:5432

which runs in the foreground (stop it with SIGTERM) once the port answers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url


def pgbouncer_problem() -> str | None:
    """Why no PgBouncer can be started here, or None."""
    if shutil.which("pgbouncer") is None:
        return "pgbouncer is not installed (apt-get install pgbouncer)"
    return None


@dataclass
class PgBouncer:
    port: int
    upstream_host: str = "127.0.0.1"
    upstream_port: int = 5432
    #: server connections per (database, user): what PostgreSQL sees of the whole fleet
    pool_size: int = 20
    max_client_conn: int = 1000
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pgbouncer-")))
    process: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> Path:
        return self.directory / "pgbouncer.ini"

    @property
    def log(self) -> Path:
        return self.directory / "pgbouncer.log"

    def url(self, database_url: str) -> str:
        """``database_url`` (a URL of the upstream server) pointed at this PgBouncer."""
        url = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.render_as_string(hide_password=False)

    def write_config(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        users = self.directory / "userlist.txt"
        users.write_text('"postgres" ""\n')
        self.config.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={self.upstream_host} port={self.upstream_port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {users}",
                    "pool_mode = transaction",
                    f"default_pool_size = {self.pool_size}",
                    f"max_client_conn = {self.max_client_conn}",
                    # Tests drop and create their databases: a login refused meanwhile
                    # ("does not exist") must not lock the database out for the default 15 s.
                    "server_login_retry = 1",
                    f"logfile = {self.log}",
                    "",
                ]
            )
        )
        os.chmod(self.directory, 0o755)
        if os.geteuid() == 0:
            for path in (self.directory, self.config, users):
                shutil.chown(path, "nobody")
            self.log.touch()
            shutil.chown(self.log, "nobody")

    def start(self, timeout: float = 20.0) -> PgBouncer:
        self.write_config()
        argv = ["pgbouncer"]
        if os.geteuid() == 0:
            argv += ["-u", "nobody"]
        self.process = subprocess.Popen(
            [*argv, str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self.process.returncode}: {self.log_tail()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen on {self.port}: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", default="127.0.0.1:5432", help="HOST:PORT of PostgreSQL")
    parser.add_argument("--pool-size", type=int, default=20)
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    bouncer = PgBouncer(args.port, host or "127.0.0.1", int(port), pool_size=args.pool_size)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bouncer.start()
    print(f"pgbouncer (transaction pooling) on 127.0.0.1:{args.port}", flush=True)
    try:
        while not stopping and bouncer.process is not None and bouncer.process.poll() is None:
            time.sleep(0.5)
    finally:
        code = bouncer.process.poll() if bouncer.process is not None else None
        tail = bouncer.log_tail()
        bouncer.stop()
    if not stopping:
        sys.exit(f"pgbouncer exited by itself ({code}):\n{tail}")


if __name__ == "__main__":
    main()
