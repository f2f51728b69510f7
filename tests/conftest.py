"""Test set-up shared by unit, integration and recovery tests.

Integration and recovery tests share one real cluster per session (see support/cluster.py); the
test process talks to the same database and broker through Charlie's public API. Which backend
is under test is printed in the header and decided by CHARLIE_TEST_DATABASE_URL /
CHARLIE_TEST_BROKER_URL (unset: SQLite + the embedded broker).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import (
    REPO,
    SANDBOX_PROBLEM,
    Backend,
    Cluster,
    McpServers,
    cluster_env,
    detect_backend,
    flush_redis,
    free_port,
    recreate_postgres_database,
)
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.fake_openai import FakeOpenAI
from tests.support.needs import in_ci, need

BACKEND, BACKEND_PROBLEM = detect_backend()
_HOME = Path(tempfile.mkdtemp(prefix="charlie-test-"))
_MODEL_PORT = free_port()
_ANTHROPIC_PORT = free_port()
_ENV = cluster_env(_HOME, BACKEND, model_port=_MODEL_PORT, anthropic_port=_ANTHROPIC_PORT)
#: The MCP servers the cluster's workers use, when tests/mcp is part of the run: a
#: run without it configures none, so the rest of the suite starts no MCP server.
_MCP = McpServers(_HOME, web_port=free_port(), flaky_port=free_port(), dead_port=free_port())
_MCP_ON = False
#: the HTTP MCP server an agent task's MCPToolset talks to (tests/support/mcp_agents.py),
#: started by the ``agent_mcp_server`` fixture of the tests that use it
_AGENT_MCP_PORT = free_port()
_ENV["CHARLIE_TEST_AGENT_MCP_PORT"] = str(_AGENT_MCP_PORT)
#: The OTLP receiver the cluster's workers export their spans to, when tests/telemetry is part
#: of the run: the whole session's workers trace then, into this test process.
_OTLP_PORT = free_port()
_OTLP: Any = None


def _wants(config: pytest.Config, folder: str, forced: str | None) -> bool:
    if forced is not None:
        return forced not in ("", "0")
    tests_dir = REPO / "tests" / folder
    for arg in config.args or ["tests"]:
        path = Path(str(arg).split("::")[0]).resolve()
        if path == tests_dir or tests_dir in path.parents or path in tests_dir.parents:
            return True
    return False


def _wants_mcp(config: pytest.Config) -> bool:
    return _wants(config, "mcp", os.environ.get("CHARLIE_TEST_MCP"))


def pytest_configure(config: pytest.Config) -> None:
    global _MCP_ON, _OTLP
    if in_ci() and SANDBOX_PROBLEM:
        # Every command in the suite would run unsandboxed and the sandbox's own tests would
        # skip: in CI that is a broken install, not a pass.
        raise pytest.UsageError(
            f"no sandbox here ({SANDBOX_PROBLEM}); CI=true requires bubblewrap (apt-get install "
            "bubblewrap): a missing part is a failure, not a skip"
        )
    if _wants_mcp(config):
        _MCP_ON = True
        _ENV.update(
            cluster_env(
                _HOME, BACKEND, model_port=_MODEL_PORT, mcp=_MCP, anthropic_port=_ANTHROPIC_PORT
            )
        )
    if _wants(config, "telemetry", os.environ.get("CHARLIE_TEST_TRACING")):
        from tests.support.otlp import OtlpReceiver

        # Started before any worker: the first spans are not refused.
        _OTLP = OtlpReceiver(_OTLP_PORT).start()
        _ENV.update(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_OTLP_PORT}",
                "OTEL_SERVICE_NAME": "charlie-test",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            }
        )
    # The test process must see the cluster's settings before charlie reads its environment.
    for key in [
        k for k in os.environ if k.startswith("CHARLIE_") and not k.startswith("CHARLIE_TEST_")
    ]:
        del os.environ[key]
    os.environ.update(_ENV)


def pytest_report_header(config: pytest.Config) -> str:
    line = f"charlie backend: {BACKEND.name} (home {_HOME})"
    if _MCP_ON:
        line += "; MCP test servers configured"
    if _OTLP is not None:
        line += f"; workers trace into an OTLP receiver on :{_OTLP_PORT}"
    if BACKEND_PROBLEM:
        line += f"; cluster tests will be skipped: {BACKEND_PROBLEM}"
    if SANDBOX_PROBLEM:
        line += (
            f"\nno sandbox here ({SANDBOX_PROBLEM}): commands run unsandboxed and the sandbox "
            "tests are skipped"
        )
    return line


@pytest.fixture(scope="session")
def backend() -> Backend:
    return BACKEND


@pytest.fixture(scope="session")
def cluster_session() -> Iterator[Cluster]:
    need(BACKEND_PROBLEM, "no cluster for this test")
    if BACKEND.database_url and BACKEND.database_url.startswith("postgresql"):
        recreate_postgres_database(BACKEND.database_url)
    if BACKEND.broker_url and BACKEND.broker_url.startswith("redis"):
        flush_redis(BACKEND.broker_url)
    from charlie.config import settings
    from charlie.store.engine import upgrade

    upgrade(settings().database_url)
    if BACKEND.broker_url and BACKEND.broker_url.startswith("amqp"):
        from charlie.app import app

        # Leftovers of an earlier run would be stale ticks: harmless, but slow to drain.
        with app.connection_for_write() as conn:
            for queue in ("charlie", "charlie.sweeps"):
                try:
                    conn.default_channel.queue_purge(queue)
                except Exception:  # the queue does not exist yet
                    conn.close()
                    conn.connect()
    servers = _start_mcp_servers() if _MCP_ON else {}
    cluster = Cluster(home=_HOME, backend=BACKEND, settings_env=dict(_ENV))
    cluster.set_faults({})
    cluster.ensure(workers=2, beat=True)
    cluster.supervise()
    yield cluster
    cluster.stop()
    for proc in servers.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


#: the HTTP MCP servers of this session (started before the cluster, so that workers find
#: them when they first discover): name -> process.
MCP_PROCESSES: dict[str, Any] = {}


def _start_mcp_servers() -> dict[str, Any]:
    MCP_PROCESSES["web"] = _MCP.start_http(_MCP.web_port, "web")
    MCP_PROCESSES["flaky"] = _MCP.start_http(_MCP.flaky_port, "flaky")
    return MCP_PROCESSES


@pytest.fixture(scope="session")
def otlp_receiver(cluster_session: Cluster) -> Any:
    """The OTLP receiver the cluster's workers export their spans to (tests/telemetry)."""
    if _OTLP is None:
        pytest.skip("workers trace only when tests/telemetry is in the run (CHARLIE_TEST_TRACING)")
    return _OTLP


@pytest.fixture(scope="session")
def mcp_servers(cluster_session: Cluster) -> McpServers:
    """The MCP test servers the cluster's workers are configured with (tests/mcp only)."""
    if not _MCP_ON:
        pytest.skip("the MCP test servers are configured only when tests/mcp is in the run")
    return _MCP


@pytest.fixture(scope="session")
def agent_mcp_server(cluster_session: Cluster) -> Iterator[McpServers]:
    """The test MCP server (streamable HTTP) of tests/support/mcp_agents.py's agent: its
    executions are in the returned servers' ledger."""
    proc = _MCP.start_http(_AGENT_MCP_PORT, "agentrec")
    yield _MCP
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def cluster(cluster_session: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The session's cluster, with two live workers and a beat, and no faults armed."""
    cluster_session.set_faults({})
    cluster_session.ensure(workers=2, beat=True)
    yield cluster_session
    cluster_session.set_faults({})
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(cluster_session.logs())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def model_server_session() -> Iterator[FakeOpenAI]:
    """A real OpenAI-compatible HTTP server on 127.0.0.1 that the cluster's workers call."""
    server = FakeOpenAI(port=_MODEL_PORT).start()
    yield server
    server.stop()


@pytest.fixture
def model_server(model_server_session: FakeOpenAI) -> FakeOpenAI:
    model_server_session.reset()
    return model_server_session


@pytest.fixture(scope="session")
def anthropic_server_session() -> Iterator[FakeAnthropic]:
    """A real HTTP server speaking Anthropic's Messages API that the cluster's workers call."""
    server = FakeAnthropic(port=_ANTHROPIC_PORT).start()
    yield server
    server.stop()


@pytest.fixture
def anthropic_server(anthropic_server_session: FakeAnthropic) -> FakeAnthropic:
    anthropic_server_session.reset()
    return anthropic_server_session


@pytest.fixture
def script(tmp_path: Path) -> Callable[..., tuple[str, Path]]:
    """Write a scripted-model file; returns (model spec, path of its call ledger)."""

    def make(turns: list[dict[str, Any]]) -> tuple[str, Path]:
        ledger = tmp_path / f"model-ledger-{uuid.uuid4().hex[:8]}.jsonl"
        path = tmp_path / f"script-{uuid.uuid4().hex[:8]}.json"
        # (a ledger stays beside its script: a path relative to the script's directory)
        path.write_text(json.dumps({"turns": turns, "ledger": ledger.name}))
        return f"scripted:{path}", ledger

    return make


def model_calls(ledger: Path) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


#: Folders whose tests talk to no database or broker unless their module says so (below).
_BACKEND_FREE_DIRS = ("unit", "devbox")
#: Names whose mention in a module means its tests reach the session's backend.
_BACKEND_NAMES = ("cluster", "get_runtime", "own_database", "BACKEND", "charlie.submit")


@functools.cache
def _reaches_backend(path: Path) -> bool:
    try:
        source = path.read_text()
    except OSError:
        return True
    return any(name in source for name in _BACKEND_NAMES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``backend_free`` what no database or broker can change the outcome of: modules
    marked so, and those under tests/unit and tests/devbox that reach no backend. CI's second
    backend round leaves them out (``-m "not backend_free"``): they ran in the first."""
    marker = pytest.mark.backend_free
    for item in items:
        path = Path(str(item.fspath))
        if item.get_closest_marker("backend_free") is not None:
            continue
        folder = path.parent.name
        if folder in _BACKEND_FREE_DIRS and not _reaches_backend(path):
            item.add_marker(marker)
