"""`charlie doctor`'s checks, one function each (charlie/doctor.py, CHECKS), each tested on its
own against a private SQLite file and settings made for the test: what it says when things are
right, and when they are not (a FAIL says what to do)."""

from __future__ import annotations

import socket
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from charlie import doctor
from charlie.config import Settings, load_settings
from charlie.doctor import Check, Context
from charlie.store.engine import get_engine, upgrade
from charlie.store.heartbeats import Heartbeat

pytestmark = pytest.mark.timeout(60)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings(tmp_path: Path, **changes: Any) -> Settings:
    base = replace(load_settings(), home=tmp_path, database_url=f"sqlite:///{tmp_path / 'c.db'}")
    return replace(base, **changes)


def migrated(tmp_path: Path, **changes: Any) -> Context:
    s = settings(tmp_path, **changes)
    upgrade(s.database_url)
    ctx = Context(s, 2.0)
    assert doctor.check_database(ctx).status == "ok"
    assert doctor.check_schema(ctx).status == "ok"
    return ctx


def test_every_check_is_listed_once_in_order() -> None:
    names = [c.__name__ for c in doctor.CHECKS]
    assert names[:2] == ["check_database", "check_schema"] and len(set(names)) == len(names)
    assert names.index("check_signing") < names.index("check_broker")
    assert names.index("check_beat") < names.index("check_workers")


def test_database(tmp_path: Path) -> None:
    missing = doctor.check_database(Context(settings(tmp_path), 2.0))
    assert missing.status == "FAIL" and "no database at" in missing.detail and missing.fix
    url = f"postgresql://u:secret@127.0.0.1:{closed_port()}/x"
    refused = doctor.check_database(Context(settings(tmp_path, database_url=url), 2.0))
    assert refused.status == "FAIL" and "secret" not in refused.detail
    assert "CHARLIE_DATABASE_URL" in refused.fix
    get_engine(settings(tmp_path).database_url).connect().close()  # creates the file
    ctx = Context(settings(tmp_path), 2.0)
    assert doctor.check_database(ctx).status == "ok" and ctx.engine is not None


def test_schema(tmp_path: Path) -> None:
    assert doctor.check_schema(Context(settings(tmp_path), 2.0)).status == "skip"
    get_engine(settings(tmp_path).database_url).connect().close()
    ctx = Context(settings(tmp_path), 2.0)
    doctor.check_database(ctx)
    bare = doctor.check_schema(ctx)
    assert bare.status == "FAIL" and "not migrated" in bare.detail and "db upgrade" in bare.fix
    assert migrated(tmp_path).schema_ok


def test_signing(tmp_path: Path) -> None:
    off = doctor.check_signing(Context(settings(tmp_path), 2.0))
    assert off.status == "ok" and off.detail.startswith("off")
    keyless = settings(
        tmp_path,
        security_key=str(tmp_path / "none.key"),
        security_certificate=str(tmp_path / "none.pem"),
        security_cert_store=str(tmp_path),
    )
    ctx = Context(keyless, 2.0)
    bad = doctor.check_signing(ctx)
    assert bad.status == "FAIL" and "CHARLIE_SECURITY_KEY" in bad.fix and not ctx.signing_ok
    assert doctor.check_broker(ctx).status == "skip"


def test_broker(tmp_path: Path) -> None:
    # the broker the process's Celery app was made with: the embedded one under this home
    ctx = Context(settings(tmp_path), 2.0)
    assert doctor.check_broker(ctx).status in ("ok", "FAIL")  # reachable or not: never raises


def test_tools(tmp_path: Path) -> None:
    ok = doctor.check_tools(Context(settings(tmp_path), 2.0))
    assert ok.status == "ok" and "recall" in ok.detail
    bad = doctor.check_tools(Context(settings(tmp_path, tool_modules=("no_such_mod_x",)), 2.0))
    assert bad.status == "FAIL" and "no_such_mod_x" in bad.detail


def test_model_limits(tmp_path: Path) -> None:
    none = doctor.check_model_limits(Context(settings(tmp_path), 2.0))
    assert none.status == "ok" and "none declared" in none.detail
    bad = doctor.check_model_limits(Context(settings(tmp_path, model_limits="{not json"), 2.0))
    assert bad.status == "FAIL" and bad.fix == "fix CHARLIE_MODEL_LIMITS"


def test_model_retries(tmp_path: Path) -> None:
    assert doctor.check_model_retries(Context(settings(tmp_path), 2.0)).status == "skip"
    ctx = migrated(tmp_path)
    quiet = doctor.check_model_retries(ctx)
    assert quiet.status == "ok" and "no run is retrying" in quiet.detail


def test_mcp(tmp_path: Path) -> None:
    # Not the suite's own MCP test servers, which a whole run puts in the environment.
    unset = {"mcp_config": None, "mcp_servers": None}
    [none] = doctor.check_mcp(Context(settings(tmp_path, **unset), 2.0))
    assert none.status == "skip"
    bad_json = {**unset, "mcp_servers": "{not json"}
    [bad] = doctor.check_mcp(Context(settings(tmp_path, **bad_json), 2.0))
    assert bad.status == "FAIL"


def test_sandbox(tmp_path: Path) -> None:
    ctx = Context(settings(tmp_path, sandbox="off"), 2.0)
    off = doctor.check_sandbox(ctx)
    assert off.status == "ok" and "CHARLIE_SANDBOX=off" in off.detail
    assert doctor.check_sandbox_network(ctx) is None  # no sandbox, no network of its own


def test_sandbox_network(tmp_path: Path) -> None:
    ctx = Context(settings(tmp_path, sandbox_net_deny="not-a-network"), 2.0)
    ctx.sandbox_ok = True
    bad = doctor.check_sandbox_network(ctx)
    assert bad is not None and bad.status == "FAIL" and "CIDR" in bad.fix


def test_devbox(tmp_path: Path) -> None:
    assert doctor.check_devbox(Context(settings(tmp_path), 2.0)).status == "skip"
    url = f"http://127.0.0.1:{closed_port()}"
    tokenless = doctor.check_devbox(Context(settings(tmp_path, devbox_url=url), 2.0))
    assert tokenless.status == "FAIL" and "without a token" in tokenless.detail
    token = "t" * 64
    down = doctor.check_devbox(Context(settings(tmp_path, devbox_url=url, devbox_token=token), 2.0))
    assert down.status == "FAIL" and "cannot reach" in down.detail


def test_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert doctor.check_traces(Context(settings(tmp_path), 2.0)).status == "skip"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    down = doctor.check_traces(Context(settings(tmp_path), 2.0))
    assert down.status == "FAIL" and "does not answer" in down.detail


def test_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHARLIE_METRICS_PORT", raising=False)
    monkeypatch.delenv("CHARLIE_BEAT_METRICS_PORT", raising=False)
    assert doctor.check_metrics(Context(settings(tmp_path), 2.0)).status == "skip"
    monkeypatch.setenv("CHARLIE_METRICS_PORT", "not-a-port")
    assert doctor.check_metrics(Context(settings(tmp_path), 2.0)).status == "FAIL"


def test_beat(tmp_path: Path) -> None:
    assert doctor.check_beat(Context(settings(tmp_path), 2.0)).status == "skip"
    ctx = migrated(tmp_path)
    never = doctor.check_beat(ctx)
    assert never.status == "FAIL" and "has ever run" in never.detail and ctx.heartbeats == {}


def beat(at: datetime, detail: str | None = None, name: str = "n") -> Heartbeat:
    return Heartbeat(name=name, at=at, worker="w", detail=detail)


def test_workers(tmp_path: Path) -> None:
    from charlie.config import TICK_QUEUE
    from charlie.store.heartbeats import WORKER_PREFIX

    ctx = Context(settings(tmp_path), 2.0)
    assert doctor.check_workers(ctx).status == "skip"
    ctx.heartbeats = {}
    assert doctor.check_workers(ctx).status == "FAIL"
    now = datetime.now(UTC)
    queues = ",".join(ctx.settings.worker_queues)
    ctx.heartbeats = {f"{WORKER_PREFIX}w1": beat(now, queues)}
    alive = doctor.check_workers(ctx)
    assert alive.status == "ok" and "1 alive: w1" in alive.detail
    ctx.heartbeats = {f"{WORKER_PREFIX}w1": beat(now, "other")}
    unserved = doctor.check_workers(ctx)
    assert unserved.status == "FAIL" and repr(TICK_QUEUE) in unserved.detail
    ctx.heartbeats = {f"{WORKER_PREFIX}w1": beat(now - timedelta(hours=1), queues)}
    assert doctor.check_workers(ctx).status == "FAIL"


def test_connections(tmp_path: Path) -> None:
    skipped = doctor.check_connections(Context(settings(tmp_path), 2.0))
    assert skipped.status == "skip" and "SQLite" in skipped.detail
    url = f"postgresql://u@127.0.0.1:{closed_port()}/x"
    unreachable = doctor.check_connections(Context(settings(tmp_path, database_url=url), 2.0))
    assert unreachable.status == "skip" and "unreachable" in unreachable.detail


def test_run_checks_runs_each_in_turn(tmp_path: Path) -> None:
    checks = doctor.run_checks(settings(tmp_path, sandbox="off"), timeout=1.0)
    assert all(isinstance(c, Check) for c in checks)
    names = [c.name for c in checks]
    assert names[:2] == ["database", "schema"] and "model calls" in names
    assert names[-1] == "connections"


def test_event_stream(tmp_path: Path) -> None:
    # events in files (the embedded broker) or Redis: the RabbitMQ stream's check does not apply
    assert doctor.check_event_stream(Context(settings(tmp_path), 2.0)) is None
    redis = settings(tmp_path, stream_url="redis://127.0.0.1:6379/0")
    assert doctor.check_event_stream(Context(redis, 2.0)) is None
    # a RabbitMQ that cannot be reached: said, as a WARN naming the queue, not raised
    amqp = settings(tmp_path, stream_url=f"amqp://guest:guest@127.0.0.1:{closed_port()}//")
    found = doctor.check_event_stream(Context(amqp, 2.0))
    assert found is not None and found.status == "WARN", found
    assert found.name == "event stream" and "could not be checked" in found.detail, found
