"""The production path as operators and Celery-only producers meet it.

`charlie doctor` names each cause of a broken deployment on its own line; a producer with only a
plain Celery app, no Charlie import and no routing, gets its `charlie.submit` run by the
workers; a worker whose broker transport cannot load says so in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.support.cluster import REPO, Cluster


def charlie_cli(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    full.update(env)
    full["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "charlie", *args],
        env=full,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def doctor(env: dict[str, str]) -> tuple[int, dict[str, dict[str, Any]]]:
    done = charlie_cli(env, "doctor", "--json", "--timeout", "2")
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    return done.returncode, checks


def fresh_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"CHARLIE_HOME": str(tmp_path / "home"), **extra}


#: the MCP servers the test cluster names broken on purpose (tests/support/cluster.py)
BROKEN_MCP = {"mcp:down", "mcp:broken"}


def test_doctor_passes_on_the_running_cluster(cluster: Cluster) -> None:
    # The sweeps record a heartbeat at most every few seconds; the beat has been running.
    # With tests/mcp in the run, the cluster names an MCP server that is down on purpose
    # (and one whose command does not exist, tests/support/cluster.py): doctor must fail on
    # them, and on nothing else.
    def healthy(checks: dict[str, dict[str, Any]]) -> bool:
        return all(c["status"] != "FAIL" for n, c in checks.items() if n not in BROKEN_MCP)

    last: list[Any] = []

    def passing() -> Any:
        result = doctor(cluster.settings_env)
        last[:] = [result]
        return healthy(result[1]) and result

    try:
        code, checks = wait_for(passing, 60, 1)
    except AssertionError:
        failed = {n: c for n, c in last[0][1].items() if c["status"] == "FAIL"}
        raise AssertionError(f"doctor still failing: {failed}") from None
    if BROKEN_MCP & set(checks):
        assert code == 1 and all(checks[n]["status"] == "FAIL" for n in BROKEN_MCP & set(checks))
    else:
        assert code == 0
    for name in ("database", "schema", "broker", "tools", "sandbox", "beat"):
        assert checks[name]["status"] == "ok", checks[name]
    # the sandbox's mode: the allow-list, the operator's read dirs, the network stack found
    if checks["sandbox"]["detail"].startswith("bubblewrap"):
        assert "allow-list" in checks["sandbox"]["detail"], checks["sandbox"]
        read_dir = cluster.settings_env["CHARLIE_SANDBOX_READ"]
        assert f"(CHARLIE_SANDBOX_READ): {read_dir}" in checks["sandbox"]["detail"]
        network = checks["sandbox:network"]
        assert network["status"] in ("ok", "skip"), network
        assert network["detail"].startswith(("pasta", "slirp4netns", "none")), network
    # the test cluster's tool module registers its tools
    assert "(tests.support.tools)" in checks["tools"]["detail"]
    assert "sleep_then" in checks["tools"]["detail"]
    # every worker records a heartbeat, whatever the broker (remote control is off)
    assert checks["workers"]["status"] == "ok", checks["workers"]
    assert " alive: " in checks["workers"]["detail"], checks["workers"]


def test_doctor_names_a_wrong_database_url(tmp_path: Path) -> None:
    code, checks = doctor(
        fresh_env(tmp_path, CHARLIE_DATABASE_URL="postgresql://charlie@127.0.0.1:1/nowhere")
    )
    assert code == 1
    assert checks["database"]["status"] == "FAIL"
    assert (
        "cannot connect to postgresql://charlie@127.0.0.1:1/nowhere"
        in (checks["database"]["detail"])
    )
    assert "CHARLIE_DATABASE_URL" in checks["database"]["fix"]
    assert checks["schema"]["status"] == "skip"


def test_doctor_names_an_unmigrated_database(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    import sqlite3

    sqlite3.connect(db).close()
    code, checks = doctor(fresh_env(tmp_path, CHARLIE_DATABASE_URL=f"sqlite:///{db}"))
    assert code == 1
    assert checks["database"]["status"] == "ok"
    assert checks["schema"]["status"] == "FAIL"
    assert "not migrated" in checks["schema"]["detail"]
    assert "charlie db upgrade" in checks["schema"]["fix"]


def test_doctor_names_a_database_behind_head(tmp_path: Path) -> None:
    from charlie.store.engine import upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0003")
    code, checks = doctor(fresh_env(tmp_path, CHARLIE_DATABASE_URL=url))
    assert code == 1
    assert checks["schema"]["status"] == "FAIL"
    assert "at revision 0003" in checks["schema"]["detail"]


def test_doctor_names_a_dead_broker(tmp_path: Path) -> None:
    code, checks = doctor(fresh_env(tmp_path, CHARLIE_BROKER_URL="redis://127.0.0.1:1/0"))
    assert code == 1
    assert checks["broker"]["status"] == "FAIL"
    assert "cannot connect to redis://127.0.0.1:1/0" in checks["broker"]["detail"]


def test_doctor_names_an_otlp_endpoint_that_does_not_answer(tmp_path: Path) -> None:
    code, checks = doctor(fresh_env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1"))
    assert code == 1
    assert checks["traces"]["status"] == "FAIL"
    assert "http://127.0.0.1:1/v1/traces does not answer" in checks["traces"]["detail"]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in checks["traces"]["fix"]
    _, quiet = doctor(fresh_env(tmp_path, OTEL_SDK_DISABLED="true"))
    assert quiet["traces"]["status"] == "skip" and quiet["metrics"]["status"] == "skip"


def test_doctor_names_a_tool_module_that_does_not_import(tmp_path: Path) -> None:
    code, checks = doctor(fresh_env(tmp_path, CHARLIE_TOOL_MODULES="no_such_package.tools"))
    assert code == 1
    assert checks["tools"]["status"] == "FAIL"
    assert "'no_such_package.tools'" in checks["tools"]["detail"]
    assert "CHARLIE_TOOL_MODULES" in checks["tools"]["fix"]


def test_a_worker_whose_tool_module_cannot_import_stops_before_consuming(tmp_path: Path) -> None:
    # It used to log the ImportError from worker_ready, say "ready" and take calls of the
    # missing tools, failing each as unknown (a worker started outside the directory that
    # PYTHONPATH=. names, as the getting-started block sets it).
    env = fresh_env(tmp_path, CHARLIE_TOOL_MODULES="no_such_package.tools")
    done = charlie_cli(env, "worker", "--pool", "solo", timeout=60)
    assert done.returncode != 0
    assert "charlie: CHARLIE_TOOL_MODULES names 'no_such_package.tools'" in done.stderr
    assert "ready" not in done.stdout + done.stderr


def test_a_worker_with_unreadable_model_limits_stops_before_consuming(tmp_path: Path) -> None:
    # It used to start, say "ready", and fail each model call it took on the setting's error.
    env = fresh_env(tmp_path, CHARLIE_MODEL_LIMITS='{"openai:": {"rpm": "lots"}}')
    done = charlie_cli(env, "worker", "--pool", "solo", timeout=60)
    assert done.returncode != 0
    last = done.stderr.splitlines()[-1]
    assert "charlie: CHARLIE_MODEL_LIMITS: 'openai:' rpm must be a whole number" in last, last
    assert "ready" not in done.stdout + done.stderr


def test_a_worker_on_an_unmigrated_postgresql_database_stops_before_consuming(
    tmp_path: Path,
) -> None:
    # It used to log SchemaMissing from worker_ready, say "ready" and consume (a newcomer who
    # skipped `charlie db upgrade`). A database of its own, created empty, stands for a fresh
    # one; reached the way the round reaches its own (directly, or through its PgBouncer).
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = os.environ.get("CHARLIE_TEST_DATABASE_URL", "")
    if not url.startswith("postgresql"):
        pytest.skip("a server database never migrated (on SQLite a worker migrates its own)")
    name = f"charlie_unmigrated_{uuid.uuid4().hex[:8]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        empty = make_url(url).set(database=name)
        env = fresh_env(tmp_path, CHARLIE_DATABASE_URL=empty.render_as_string(False))
        done = charlie_cli(env, "worker", "--pool", "solo", timeout=60)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    assert done.returncode != 0
    assert "run `charlie db upgrade` first" in done.stderr.splitlines()[-1]
    assert "ready" not in done.stdout + done.stderr


def test_submit_names_a_tool_module_that_does_not_import_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "turns.json"
    script.write_text(json.dumps([{"say": "done"}]))
    env = fresh_env(tmp_path, CHARLIE_TOOL_MODULES="no_such_package.tools")
    done = charlie_cli(env, "submit", "x", "--model", f"scripted:{script}", "--tool", "mine")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("charlie: CHARLIE_TOOL_MODULES names 'no_such_package.tools'")


def test_doctor_names_a_devbox_that_refuses_the_token(tmp_path: Path) -> None:
    from charlie.devbox.server import DevboxServer

    right = "right-token-0123456789abcdefghijklm"
    server = DevboxServer(root=tmp_path / "devbox", token=right, port=0).start()
    try:
        env = fresh_env(
            tmp_path,
            CHARLIE_DEVBOX_URL=server.url,
            CHARLIE_DEVBOX_TOKEN="wrong-token-0123456789abcdefghijklm",
        )
        code, checks = doctor(env)
        assert code == 1
        assert checks["devbox"]["status"] == "FAIL"
        assert "401" in checks["devbox"]["detail"]
        assert "CHARLIE_DEVBOX_TOKEN" in checks["devbox"]["fix"]
        # a token under the devbox's minimum is named as such, before any request
        env["CHARLIE_DEVBOX_TOKEN"] = "short-token"
        code, checks = doctor(env)
        assert code == 1 and checks["devbox"]["status"] == "FAIL"
        assert "at least 32" in checks["devbox"]["detail"]
        assert "short-token" not in json.dumps(checks)
        env["CHARLIE_DEVBOX_TOKEN"] = right
        _, checks = doctor(env)
        assert checks["devbox"]["status"] == "ok", checks["devbox"]
    finally:
        server.stop()


def test_doctor_fails_when_no_sweep_has_run(tmp_path: Path) -> None:
    from charlie.store.engine import upgrade

    url = f"sqlite:///{tmp_path / 'quiet.db'}"
    upgrade(url)
    code, checks = doctor(fresh_env(tmp_path, CHARLIE_DATABASE_URL=url))
    assert code == 1
    assert checks["beat"]["status"] == "FAIL"
    assert "charlie beat" in checks["beat"]["fix"]
    assert checks["workers"]["status"] == "FAIL"
    assert "charlie worker" in checks["workers"]["fix"]


def test_doctor_names_a_setting_that_does_not_parse(tmp_path: Path) -> None:
    done = charlie_cli(fresh_env(tmp_path, CHARLIE_LEASE_SECONDS="soon"), "doctor")
    assert done.returncode == 1
    assert "FAIL  config" in done.stdout
    assert "CHARLIE_LEASE_SECONDS='soon' is not a number" in done.stdout


def test_a_worker_whose_transport_cannot_load_says_so_in_one_line(tmp_path: Path) -> None:
    # kombu's SQS transport needs boto3, which Charlie does not install: the same failure a
    # missing Redis dependency used to give, with the cause named instead of a traceback.
    done = charlie_cli(fresh_env(tmp_path, CHARLIE_BROKER_URL="sqs://"), "worker", timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("charlie: the broker transport for sqs:// cannot be loaded")
    assert "Traceback" not in done.stderr


def _plain_celery_app(cluster: Cluster) -> Any:
    """A producer's own Celery app: Celery's defaults, no routing, no Charlie settings."""
    from celery import Celery

    url = cluster.settings_env.get("CHARLIE_BROKER_URL")
    if url:
        return Celery("producer", broker=url)
    # The embedded broker is Charlie's own kombu transport, so a producer on it must register
    # it; nothing else of Charlie's configuration is used (no queues, no routes).
    from charlie import broker

    broker.register()
    home = Path(cluster.settings_env["CHARLIE_HOME"])
    return Celery(
        "producer",
        broker="charliefs://",
        broker_transport_options=broker.transport_options(home / "broker", 0.01),
    )


def test_a_celery_only_producer_task_runs(cluster: Cluster, script: Any) -> None:
    from charlie import api

    model, _ = script(
        [
            {"say": "look", "tool_calls": [{"id": "c1", "name": "list_files", "arguments": {}}]},
            {"say": "listed"},
        ]
    )
    producer = _plain_celery_app(cluster)
    assert producer.conf.task_default_queue == "celery"
    with_kwarg = "celery-only-kwarg"
    producer.send_task(
        "charlie.submit", kwargs={"prompt": "list", "model": model, "task_id": with_kwarg}
    )
    # The message's own id names the task when the kwargs carry none.
    result = producer.send_task(
        "charlie.submit", kwargs={"prompt": "list", "model": model}, task_id="celery-only-msgid"
    )
    assert result.id == "celery-only-msgid"
    for task_id in (with_kwarg, "celery-only-msgid"):
        wait_for(lambda t=task_id: _exists(t), timeout=60)  # the submit crosses the broker
        info = api.wait(task_id, timeout=60)
        assert info.status.value == "succeeded", info
        assert info.result == {"answer": "listed", "final_seq": 5}


def _exists(task_id: str) -> bool:
    from charlie import api
    from charlie.scheduler import TaskNotFound

    try:
        api.get_task(task_id)
    except TaskNotFound:
        return False
    return True


def test_submit_task_delay_keeps_working(cluster: Cluster, script: Any) -> None:
    from charlie import api
    from charlie.worker import submit_task

    model, _ = script([{"say": "done"}])
    submit_task.delay("hello", model=model, task_id="delay-keeps-working")
    wait_for(lambda: _exists("delay-keeps-working"), timeout=60)
    info = api.wait("delay-keeps-working", timeout=60)
    assert info.status.value == "succeeded", info
