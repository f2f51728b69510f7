"""A real Charlie cluster for tests: worker processes and beat over a real broker and database.

Workers run as separate process groups, so a test can SIGKILL one whole worker (main process and
pool children) the way a machine dies. Backends:

- embedded (default): SQLite + Charlie's filesystem broker under a temporary CHARLIE_HOME;
- servers: set CHARLIE_TEST_DATABASE_URL (PostgreSQL) and CHARLIE_TEST_BROKER_URL (Redis or
  RabbitMQ). The database named in the URL is dropped and created again for the session.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[2]


#: CHARLIE_TEST_POOL as this module found it when imported (scripts/chaos.py clears the
#: CHARLIE_* environment before it makes its cluster)
_TEST_POOL = os.environ.get("CHARLIE_TEST_POOL")


def default_pool() -> str:
    """The test workers' pool: prefork (one task per process, as the suites were written
    for), or CHARLIE_TEST_POOL's."""
    return _TEST_POOL or "prefork"


@dataclass(frozen=True)
class Backend:
    name: str
    database_url: str | None
    broker_url: str | None

    @property
    def embedded(self) -> bool:
        return self.database_url is None


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or default_port), 2
        ):
            return True
    except OSError:
        return False


def detect_backend() -> tuple[Backend, str | None]:
    """The backend to test and, if it cannot be used here, why."""
    db = os.environ.get("CHARLIE_TEST_DATABASE_URL")
    broker = os.environ.get("CHARLIE_TEST_BROKER_URL")
    if not db and not broker:
        return Backend("sqlite+embedded", None, None), None
    backend = Backend(
        f"{(db or 'sqlite').split(':')[0]}+{(broker or 'embedded').split(':')[0]}", db, broker
    )
    if db and db.startswith("postgresql") and not _reachable(db, 5432):
        return (
            backend,
            f"PostgreSQL at {db} is not reachable (README: docker compose up -d postgres)",
        )
    if broker and broker.startswith("redis") and not _reachable(broker, 6379):
        return (
            backend,
            f"Redis at {broker} is not reachable (README: docker compose up -d redis)",
        )
    if broker and broker.startswith("amqp") and not _reachable(broker, 5672):
        return backend, f"RabbitMQ at {broker} is not reachable"
    return backend, None


def recreate_postgres_database(url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    target = make_url(url)
    admin = create_engine(
        target.set(database="postgres").render_as_string(hide_password=False),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{target.database}"'))
    admin.dispose()
    # Through a PgBouncer, a login it tried between the drop and the create failed, and it
    # refuses logins to the database for server_login_retry: wait until one succeeds.
    from sqlalchemy import pool
    from sqlalchemy.exc import OperationalError

    probe = create_engine(url, poolclass=pool.NullPool)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                with probe.connect() as conn:
                    conn.execute(text("SELECT 1"))
                return
            except OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
    finally:
        probe.dispose()


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


@dataclass
class Cluster:
    home: Path
    backend: Backend
    settings_env: dict[str, str]
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    beats: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _serial: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    want_workers: int = 2
    restarts: int = 0
    #: serve Prometheus metrics: every worker and beat started gets a port of its
    #: own (CHARLIE_METRICS_PORT, CHARLIE_BEAT_METRICS_PORT), recorded here by process id.
    metrics: bool = False
    #: the workers' pool (metered clusters may run threads or solo); CHARLIE_TEST_POOL runs a
    #: whole round on another (CI's threads round: a SIGKILL takes every call of the process)
    pool: str = field(default_factory=lambda: default_pool())
    #: each worker's slots, unless start_worker is given its own (scripts/chaos.py's
    #: --concurrency)
    concurrency: int = 2
    metrics_ports: dict[int, int] = field(default_factory=dict)
    #: more environment for the workers and beat started from now on (reconfigured())
    extra_env: dict[str, str] = field(default_factory=dict)
    #: RLIMIT_AS of every worker started (bytes; None: no limit): a worker that tries to hold
    #: more memory than this gets MemoryError instead of taking the machine's.
    address_space: int | None = None
    #: the schedule file of each beat started, by process id: a beat touches it after each
    #: sweep round (sweep_rounds)
    beat_schedules: dict[int, Path] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
        env.update(self.settings_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env

    @property
    def faults_path(self) -> Path:
        return Path(self.settings_env["CHARLIE_FAULTS"])

    @property
    def ledger_path(self) -> Path:
        return Path(self.settings_env["CHARLIE_TEST_LEDGER"])

    def _spawn(
        self,
        args: list[str],
        log_name: str,
        env: dict[str, str] | None = None,
        address_space: int | None = None,
        prefix: list[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        def limit() -> None:
            if address_space is not None:
                resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

        with open(self.home / log_name, "ab") as log:
            return subprocess.Popen(
                # (a prefix that execs, as ``ip netns exec`` does, keeps the process's pid)
                [*(prefix or []), sys.executable, "-m", "charlie", *args],
                env={**self.env, **self.extra_env, **(env or {})},
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: SIGKILL takes all of it
                preexec_fn=limit if address_space is not None else None,
            )

    def start_worker(
        self,
        concurrency: int | None = None,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
        as_started: bool = False,
    ) -> subprocess.Popen[bytes]:
        """A worker; ``prefix`` runs it through another command (``ip netns exec NS``: on
        another host), with ``env`` besides the cluster's settings. ``as_started``: with no
        pool or concurrency of the test's, as `charlie worker` starts by default."""
        self._serial += 1
        name = f"w{self._serial}"
        port = free_port() if self.metrics else None
        slots = self.concurrency if concurrency is None else concurrency
        pool_args = [] if as_started else ["-c", str(slots), "--pool", self.pool]
        proc = self._spawn(
            ["worker", *pool_args, "-n", f"{name}@%h"],
            f"worker-{name}.log",
            {**(env or {}), **({"CHARLIE_METRICS_PORT": str(port)} if port else {})},
            address_space=self.address_space,
            prefix=prefix,
        )
        if port:
            self.metrics_ports[proc.pid] = port
        self.workers.append(proc)
        return proc

    def start_beat(self) -> subprocess.Popen[bytes]:
        self._serial += 1
        schedule = self.home / f"beat-{self._serial}.schedule"
        port = free_port() if self.metrics else None
        metrics = {"CHARLIE_BEAT_METRICS_PORT": str(port), "CHARLIE_METRICS_GAUGE_SECONDS": "0"}
        proc = self._spawn(
            ["beat", "--schedule", str(schedule)],
            f"beat-{self._serial}.log",
            metrics if port else None,
        )
        if port:
            self.metrics_ports[proc.pid] = port
        self.beats.append(proc)
        self.beat_schedules[proc.pid] = schedule
        return proc

    def sweep_rounds(self, rounds: int = 2, timeout: float = 60.0) -> None:
        """Wait until a live beat has ended ``rounds`` sweep rounds from now (its schedule file
        is touched after each): what a test asserts never happened is then told from what has
        not happened yet. A round under way now ends first: two rounds hold one begun after
        this call."""

        def stamp() -> int | None:
            for proc in self.beats:
                path = self.beat_schedules.get(proc.pid)
                if proc.poll() is None and path is not None and path.exists():
                    return path.stat().st_mtime_ns
            return None

        deadline = time.monotonic() + timeout
        seen, last = 0, stamp()
        while seen < rounds:
            if time.monotonic() > deadline:
                raise AssertionError(f"the beat did not end {rounds} sweep rounds in {timeout} s")
            time.sleep(0.05)
            now = stamp()
            if now is not None and now != last:
                seen, last = seen + (last is not None), now

    @contextlib.contextmanager
    def metered(self, pool: str = "prefork") -> Iterator[Cluster]:
        """The cluster's workers and beat replaced by ones that serve metrics, for a while;
        the plain ones come back after."""
        with self._lock:
            self._terminate(self.workers + self.beats)
            self.workers, self.beats, self.metrics, self.pool = [], [], True, pool
            self.ensure(workers=self.want_workers, beat=True)
        try:
            yield self
        finally:
            with self._lock:
                self._terminate(self.workers + self.beats)
                self.workers, self.beats, self.metrics, self.pool = [], [], False, default_pool()
                self.metrics_ports.clear()
                self.ensure(workers=self.want_workers, beat=True)

    @contextlib.contextmanager
    def configured(self, **env: str) -> Iterator[Cluster]:
        """The cluster's workers replaced by ones started with these settings besides the
        session's (CHARLIE_*), for a while; the plain ones come back after. The supervisor
        restarts a killed worker with them too, meanwhile. The test process's own commands
        (``env``) see them too."""
        with self._lock:
            before = dict(self.settings_env)
            self.settings_env.update(env)
            self._terminate(self.workers)
            self.workers = []
            self.ensure(workers=self.want_workers, beat=True)
        try:
            yield self
        finally:
            with self._lock:
                self.settings_env.clear()
                self.settings_env.update(before)
                self._terminate(self.workers)
                self.workers = []
                self.ensure(workers=self.want_workers, beat=True)

    @contextlib.contextmanager
    def reconfigured(self, env: dict[str, str]) -> Iterator[Cluster]:
        """The cluster's workers and beat replaced by ones started with ``env`` added, for a
        while (a worker that requires signed messages, one with Celery actions off); the plain
        ones come back after. Unlike configured(), the test process's commands do not see it
        (an unsigned producer stays unsigned)."""
        with self._lock:
            self._terminate(self.workers + self.beats)
            self.workers, self.beats, self.extra_env = [], [], dict(env)
            self.ensure(workers=self.want_workers, beat=True)
        try:
            yield self
        finally:
            with self._lock:
                self._terminate(self.workers + self.beats)
                self.workers, self.beats, self.extra_env = [], [], {}
                self.ensure(workers=self.want_workers, beat=True)

    @contextlib.contextmanager
    def limited(self, address_space: int, workers: int = 1) -> Iterator[Cluster]:
        """The cluster's workers replaced, for a while, by ``workers`` whose address space is
        limited to ``address_space`` bytes (RLIMIT_AS); the plain ones come back after."""
        with self._lock:
            self._terminate(self.workers)
            self.workers, self.address_space = [], address_space
            kept, self.want_workers = self.want_workers, workers
            self.ensure(workers=workers, beat=True)
        try:
            yield self
        finally:
            with self._lock:
                self._terminate(self.workers)
                self.workers, self.address_space = [], None
                self.ensure(workers=kept, beat=True)

    @contextlib.contextmanager
    def without_workers(self) -> Iterator[Cluster]:
        """The cluster's workers stopped for a while (the beat keeps running): the workers a
        test starts meanwhile (start_worker) are the only ones, and the supervisor restarts
        none of them. On exit those are stopped and the plain ones come back."""
        with self._lock:
            self._terminate(self.workers)
            self.workers = []
            kept, self.want_workers = self.want_workers, 0
        try:
            yield self
        finally:
            with self._lock:
                self._terminate(self.workers)
                self.workers = []
                self.ensure(workers=kept, beat=True)

    def worker_processes(self) -> dict[int, list[int]]:
        """Each live worker's processes (its main process and pool children: its process
        group), by the worker's pid."""
        found: dict[int, list[int]] = {w.pid: [] for w in self.alive_workers()}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    group = os.getpgid(int(entry.name))
                    if group in found:
                        found[group].append(int(entry.name))
        return found

    def worker_metrics_ports(self) -> list[int]:
        return [
            self.metrics_ports[w.pid] for w in self.alive_workers() if w.pid in self.metrics_ports
        ]

    def beat_metrics_port(self) -> int:
        (port,) = [self.metrics_ports[b.pid] for b in self.beats if b.poll() is None]
        return port

    def alive_workers(self) -> list[subprocess.Popen[bytes]]:
        return [w for w in self.workers if w.poll() is None]

    def ensure(self, workers: int = 2, beat: bool = True) -> None:
        with self._lock:
            self.want_workers = workers
            self.workers = self.alive_workers()
            while len(self.workers) < workers:
                self.start_worker()
            self.beats = [b for b in self.beats if b.poll() is None]
            if beat and not self.beats:
                self.start_beat()

    def supervise(self) -> None:
        """Restart dead workers, as systemd or Kubernetes would: a killed worker is replaced
        within about half a second, so recovery comes from the sweep, not from the test."""

        def loop() -> None:
            while not self._stopping.wait(0.3):
                with self._lock:
                    dead = [w for w in self.workers if w.poll() is not None]
                    if dead:
                        self.restarts += len(dead)
                        self.workers = self.alive_workers()
                        while len(self.workers) < self.want_workers:
                            self.start_worker()

        self._supervisor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervisor.start()

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL a whole worker: its main process and its pool children."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def kill_pid_group(self, pid: int) -> None:
        """SIGKILL the worker whose process group contains ``pid``."""
        pgid = os.getpgid(pid)
        os.killpg(pgid, signal.SIGKILL)
        for proc in self.workers:
            if proc.pid == pgid:
                proc.wait(timeout=10)

    def set_faults(self, faults: dict[str, Any]) -> None:
        counter = self.faults_path.with_suffix(".count")
        if counter.exists():
            counter.unlink()
        self.faults_path.write_text(json.dumps(faults))

    def fault_count(self, point: str) -> int:
        counter = self.faults_path.with_suffix(".count")
        if not counter.exists():
            return 0
        return int(json.loads(counter.read_text() or "{}").get(point, 0))

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        self._terminate(self.workers + self.beats)

    def _terminate(self, procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                # TERM to the main process: it shuts its own pool down.
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        out = []
        for path in sorted(self.home.glob("*.log")):
            out.append(f"==== {path.name}\n{path.read_text(errors='replace')[-6000:]}")
        return "\n".join(out)


#: ports free_port() handed out in this process (each test server gets its own)
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port for a server that starts listening later: free now, never handed out before in
    this process, and below the kernel's ephemeral range, so that neither an outgoing
    connection nor a server started with port 0 (``charlie ui --port 0``) can take it in the
    meantime (one did: the MCP test server found its port taken by a console).
    ``CHARLIE_TEST_PORTS=LOW-HIGH`` narrows the range: CI's two lanes run side by side, each
    in a range of its own, so that a port one lane picked is not taken by the other's server
    before it binds it."""
    first, last = _port_range()
    for _ in range(500):
        port = random.randrange(first, last + 1)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _port_range() -> tuple[int, int]:
    """The ports free_port picks from (both ends included)."""
    raw = os.environ.get("CHARLIE_TEST_PORTS", "").strip()
    if raw:
        first, _, last = raw.partition("-")
        return int(first), int(last)
    low = _ephemeral_low()
    return max(1024, low - 12000), low - 1


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _sandbox_problem() -> str | None:
    from charlie.sandbox import bwrap_problem

    return bwrap_problem()


#: Why commands cannot run in bubblewrap here (None: they can). Where they cannot, the suite
#: runs commands unsandboxed (the operator's opt-out) and the sandbox's own tests skip.
SANDBOX_PROBLEM = _sandbox_problem()
#: the devbox's and the workers' sandbox mode for this run.
TEST_SANDBOX = "off" if SANDBOX_PROBLEM else "bwrap"

#: The key the workers send to the fake model server; tests check it never leaks.
#: the context window the cluster's workers are configured with for "fake-windowed" models
FAKE_WINDOW_TOKENS = 5000
#: the context window of the replay tests' scripted model (tests/integration/test_replay.py):
#: small, so that its one run compacts its input once
REPLAY_WINDOW_TOKENS = 2000


def replay_script(home: Path) -> Path:
    """Where the replay tests write their scripted model: a path known when the workers start,
    so its window is a setting of theirs (CHARLIE_MODEL_<NAME>_CONTEXT_TOKENS)."""
    return home / "replay-model" / "parent.json"


FAKE_MODEL_KEY = "sk-charlie-test-0123456789"


#: The MCP test servers' tokens (their config's env and headers): tests check they never leak.
MCP_STDIO_TOKEN = "stdio-secret-4f1c9e27b8"
MCP_HTTP_TOKEN = "http-secret-a83d0c5e61"
MCP_SERVER_SCRIPT = REPO / "tests" / "support" / "mcp_server.py"


@dataclass(frozen=True)
class McpServers:
    """The MCP servers of a test cluster: ``files`` over stdio (one per worker
    process), ``web`` and ``web_strict`` (one HTTP server, two configurations: the second
    ignores its hints, holds interrupted calls, needs approval for ``delete_record``), ``flaky``
    (an HTTP server a test stops), ``down`` (nothing listens) and ``broken`` (its command
    does not exist)."""

    home: Path
    web_port: int
    flaky_port: int
    dead_port: int
    #: configure only these servers (None: all of them).
    only: tuple[str, ...] | None = None

    @property
    def ledger(self) -> Path:
        return self.home / "mcp-ledger.jsonl"

    @property
    def down_flag(self) -> Path:
        """While this file exists, a stdio ``files`` server exits as it starts."""
        return self.home / "mcp-files-down"

    @property
    def tasks_dir(self) -> Path:
        """The test servers' task records (any of their processes follows a task)."""
        return self.home / "mcp-tasks"

    @property
    def config_path(self) -> Path:
        return self.home / "mcp.json"

    def config(self) -> dict[str, Any]:
        stdio_env = {
            "MCP_TEST_LEDGER": str(self.ledger),
            "MCP_TEST_TOKEN": MCP_STDIO_TOKEN,
            "MCP_TEST_NAME": "files",
            "MCP_TEST_DOWN_FLAG": str(self.down_flag),
            "MCP_TEST_TASKS_DIR": str(self.tasks_dir),
        }
        auth = {"Authorization": f"Bearer {MCP_HTTP_TOKEN}"}
        web = f"http://127.0.0.1:{self.web_port}/mcp"
        return {
            "mcpServers": {
                "files": {
                    "command": sys.executable,
                    "args": [str(MCP_SERVER_SCRIPT)],
                    "env": stdio_env,
                    "tools": {
                        "unhinted": {"effect": "read"},
                        "confirm_delete": {"deadline": 60},
                        "flood": {"deadline": 120},
                    },
                },
                "web": {"url": web, "headers": auth},
                "web_strict": {
                    "type": "http",
                    "url": web,
                    "headers": auth,
                    "ignore_hints": True,
                    "on_interrupt": "hold",
                    "tools": {"delete_record": {"approval": True}},
                },
                "flaky": {"url": f"http://127.0.0.1:{self.flaky_port}/mcp", "headers": auth},
                "down": {"url": f"http://127.0.0.1:{self.dead_port}/mcp"},
                "broken": {"command": str(self.home / "no-such-mcp-server")},
                "off": {"command": "never-started", "disabled": True},
            }
        }

    def write_config(self) -> Path:
        config = self.config()
        if self.only is not None:
            servers = config["mcpServers"]
            config["mcpServers"] = {k: v for k, v in servers.items() if k in self.only}
        self.config_path.write_text(json.dumps(config, indent=2))
        return self.config_path

    def start_http(self, port: int, name: str) -> subprocess.Popen[bytes]:
        """An HTTP MCP server of the test script on ``port``, ready when this returns."""
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")},
            "MCP_TEST_LEDGER": str(self.ledger),
            "MCP_TEST_TOKEN": MCP_HTTP_TOKEN,
            "MCP_TEST_NAME": name,
            "MCP_TEST_TASKS_DIR": str(self.tasks_dir),
        }
        with open(self.home / f"mcp-{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, str(MCP_SERVER_SCRIPT), "--http", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.time() + 30
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the MCP test server {name} exited: see mcp-{name}.log")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                # (something else answering on the port is not this server: it exits on a
                # taken port, so give it a moment to)
                time.sleep(0.3)
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the MCP test server {name} exited (port {port} taken?): "
                        f"see mcp-{name}.log"
                    )
                return proc
            time.sleep(0.1)
        proc.kill()
        raise RuntimeError(f"the MCP test server {name} did not listen on {port}")


def kill_mcp_server(pid: int) -> bool:
    """SIGKILL a stdio MCP test server by its pid (from a ledger), only if that pid is still
    one (a pid is reused once its process is gone). True: it was killed."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if str(MCP_SERVER_SCRIPT).encode() not in cmdline:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        return True
    return False


def fused_commits(backend: Backend) -> bool:
    """Whether the cluster writes a merged transaction's steps in one statement (PostgreSQL,
    inline steps on, CHARLIE_FUSE_COMMITS not 0): its kill points and its costs
    differ from the statement-by-statement path's."""
    return (
        bool(backend.database_url and backend.database_url.startswith("postgresql"))
        and os.environ.get("CHARLIE_TEST_FUSE_COMMITS", "1") != "0"
        and os.environ.get("CHARLIE_TEST_INLINE_PHASES", "30") != "0"
    )


def operator_read_dir(home: Path) -> Path:
    """The session's CHARLIE_SANDBOX_READ: outside everything the sandbox shows by itself."""
    return Path("/srv") / f"charlie-test-read-{home.parent.name}-{home.name}"


def cluster_env(
    home: Path,
    backend: Backend,
    model_port: int | None = None,
    mcp: McpServers | None = None,
    anthropic_port: int | None = None,
) -> dict[str, str]:
    env = {
        "CHARLIE_HOME": str(home),
        "CHARLIE_TOOL_MODULES": "tests.support.tools",
        "CHARLIE_TEST_LEDGER": str(home / "tool-ledger.jsonl"),
        "CHARLIE_FAULTS": str(home / "faults.json"),
        # Short leases and sweeps so recovery happens within a test's patience.
        "CHARLIE_LEASE_SECONDS": "2",
        "CHARLIE_STALL_SECONDS": "2",
        "CHARLIE_SWEEP_INTERVAL": "0.5",
        "CHARLIE_MAX_ATTEMPTS": "3",
        "CHARLIE_DISPATCH_BATCH": "4",
        # Questions to a person time out within a test (tests/integration/test_people.py).
        "CHARLIE_HUMAN_DEADLINE": "20",
        "CHARLIE_TASK_EVENTS": "0",
        "CHARLIE_SANDBOX": TEST_SANDBOX,
        # A directory the operator lets commands read besides the sandbox's allow-list (made
        # by the sandbox's tests, tests/integration/test_sandbox_allowlist.py).
        "CHARLIE_SANDBOX_READ": str(operator_read_dir(home)),
        # Tests give tasks workspaces under pytest's tmp dirs.
        "CHARLIE_WORKSPACE_ROOTS": f"{home / 'workspaces'}:{tempfile.gettempdir()}",
        # Every test script is a model of its own: children may use any scripted model; no
        # other model.
        "CHARLIE_DELEGATE_MODELS": "scripted:*",
    }
    # Another inline-step budget for a whole suite (0: every step published):
    # CHARLIE_TEST_INLINE_PHASES=0 python -m pytest
    if os.environ.get("CHARLIE_TEST_INLINE_PHASES"):
        env["CHARLIE_INLINE_PHASES"] = os.environ["CHARLIE_TEST_INLINE_PHASES"]
    # ...and PostgreSQL's merged transactions written statement by statement instead of fused:
    # CHARLIE_TEST_FUSE_COMMITS=0 python -m pytest
    if os.environ.get("CHARLIE_TEST_FUSE_COMMITS"):
        env["CHARLIE_FUSE_COMMITS"] = os.environ["CHARLIE_TEST_FUSE_COMMITS"]
    # ...and RabbitMQ's tick queue declared with message priorities (an opt-in: the queue must
    # not exist with other arguments, so on a vhost of the test's own):
    # CHARLIE_TEST_RABBITMQ_MAX_PRIORITY=10 python -m pytest
    # ...and Redis's (an opt-in): CHARLIE_TEST_REDIS_PRIORITIES=1 python -m pytest
    if os.environ.get("CHARLIE_TEST_REDIS_PRIORITIES"):
        env["CHARLIE_REDIS_PRIORITIES"] = os.environ["CHARLIE_TEST_REDIS_PRIORITIES"]
    if os.environ.get("CHARLIE_TEST_RABBITMQ_MAX_PRIORITY"):
        env["CHARLIE_RABBITMQ_MAX_PRIORITY"] = os.environ["CHARLIE_TEST_RABBITMQ_MAX_PRIORITY"]
    from charlie.models.retry import env_name

    scripted = env_name(str(replay_script(home)))
    env[f"CHARLIE_MODEL_{scripted}_CONTEXT_TOKENS"] = str(REPLAY_WINDOW_TOKENS)
    if model_port is not None:
        env["CHARLIE_MODEL_BASE_URL"] = f"http://127.0.0.1:{model_port}/v1"
        env["CHARLIE_MODEL_API_KEY"] = FAKE_MODEL_KEY
        env["CHARLIE_MODEL_TIMEOUT"] = "10"
        # "fake-windowed" has a context window of its own (tests/integration/test_long_runs.py)
        env["CHARLIE_MODEL_FAKE_WINDOWED_CONTEXT_TOKENS"] = str(FAKE_WINDOW_TOKENS)
    if anthropic_port is not None:
        from tests.support.fake_anthropic import FAKE_ANTHROPIC_KEY

        # The fake Messages API (tests/support/fake_anthropic.py), as the SDK is pointed at one;
        # "claude-fake-thinker" thinks (extended thinking, a budget of 2048 tokens).
        env["ANTHROPIC_BASE_URL"] = f"http://127.0.0.1:{anthropic_port}"
        env["ANTHROPIC_API_KEY"] = FAKE_ANTHROPIC_KEY
        env["CHARLIE_MODEL_CLAUDE_FAKE_WINDOWED_CONTEXT_TOKENS"] = str(FAKE_WINDOW_TOKENS)
        env["CHARLIE_MODEL_CLAUDE_FAKE_THINKER_THINKING_BUDGET"] = "2048"
    if mcp is not None:
        # The workers' MCP servers: a server that is down is tried again soon.
        env["CHARLIE_MCP_CONFIG"] = str(mcp.write_config())
        env["CHARLIE_MCP_RETRY_SECONDS"] = "2"
        env["CHARLIE_MCP_TIMEOUT"] = "15"
    if backend.database_url:
        env["CHARLIE_DATABASE_URL"] = backend.database_url
    if backend.broker_url:
        env["CHARLIE_BROKER_URL"] = backend.broker_url
    return env
