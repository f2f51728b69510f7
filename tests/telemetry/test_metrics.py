"""Prometheus metrics: scraped over HTTP from real prefork workers and a beat,
and the Grafana dashboard checked against what the observer registers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

import charlie
import tests.support.tools  # noqa: F401  (registers the test tools: boom, sleep_then, ...)
from charlie.domain import Phase, TaskStatus
from charlie.observe import NOOP, CallEvent, ModelCallEvent, TickScope
from charlie.telemetry import build_observer
from charlie.telemetry.metrics import (
    LABEL_CAP,
    MetricsObserver,
    _Bounded,
    model_label,
    tool_label,
)
from tests.conftest import wait_for
from tests.support.cluster import REPO, Cluster, free_port
from tests.support.metrics import by, scrape, scrape_all, total, wait_serving

pytestmark = pytest.mark.timeout(180)

DASHBOARD = REPO / "deploy" / "grafana" / "charlie.json"


def tid() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


def _registry() -> tuple[MetricsObserver, object]:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    return MetricsObserver(registry=registry, gauge_seconds=0), registry


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()  # type: ignore[attr-defined]
        for s in family.samples
    }


# -- without a cluster ---------------------------------------------------------------------


def test_no_port_no_observer_and_no_prometheus_import() -> None:
    """Nothing configured: the runtime keeps NOOP (the hot path pays nothing), and building
    the observer imports no prometheus_client."""
    code = (
        "import sys; from charlie.telemetry import build_observer;"
        "from charlie.observe import NOOP; assert build_observer({}) is NOOP;"
        "assert 'prometheus_client' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert build_observer({"CHARLIE_METRICS_PORT": ""}) is NOOP


def test_the_observer_counts_ticks_calls_models_and_gauges() -> None:
    observer, registry = _registry()
    scope = TickScope("x-1", Phase.ADVANCE_TURN, 3, "w")
    with observer.tick(scope):
        scope.result, scope.to = "moved", Phase.CALL_MODEL
        scope.results = (("boom", "error"), ("no_such_tool_xyz", "ok"))
    observer.model_call(
        ModelCallEvent("t", "x", 1, "openai:gpt 4.1\n", 1.0, 2.5, "ok", 10, 20, 5, "stop")
    )
    observer.call_settled(CallEvent("t", "x", 1, "c", "boom", "ok", "w", 2.0, late=True))
    observer.call_settled(CallEvent("t", "x", 1, "c", "boom", "ok", "w", 2.0, duration_ms=30))
    observer.gauges(
        lambda: {
            "runs": {"await_tools": 2},
            "tasks": {"running": 3},
            "open_tool_calls": 4,
            "waiting_for_person": {"approval": 1, "reply": 0},
            "oldest_stalled_run_seconds": 7.5,
            "queue_depth": {"charlie": 9, "charlie.sweeps": None},
        }
    )
    got = _samples(registry)
    assert (
        got[("charlie_transitions_total", (("phase", "advance_turn"), ("to", "call_model")))] == 1
    )
    assert got[("charlie_tool_calls_total", (("outcome", "error"), ("tool", "boom")))] == 1
    # a name the model made up is no label of its own
    assert got[("charlie_tool_calls_total", (("outcome", "ok"), ("tool", "unregistered")))] == 1
    assert got[("charlie_tool_late_reports_total", (("outcome", "ok"), ("tool", "boom")))] == 1
    assert got[("charlie_tool_call_duration_seconds_count", (("tool", "boom"),))] == 1
    model = (("model", "openai:gpt_4.1_"),)
    assert got[("charlie_model_calls_total", (*model, ("outcome", "ok")))] == 1
    assert got[("charlie_tokens_total", (("kind", "output"), model[0]))] == 20
    assert got[("charlie_tokens_total", (("kind", "reasoning"), model[0]))] == 5
    assert got[("charlie_model_call_duration_seconds_sum", model)] == 1.5
    assert got[("charlie_phase_duration_seconds_count", (("phase", "advance_turn"),))] == 1
    assert got[("charlie_runs", (("phase", "await_tools"),))] == 2
    assert got[("charlie_runs", (("phase", "call_model"),))] == 0
    assert got[("charlie_open_tool_calls", ())] == 4
    assert got[("charlie_tasks_waiting_for_person", (("kind", "approval"),))] == 1
    assert got[("charlie_oldest_stalled_run_seconds", ())] == 7.5
    assert got[("charlie_broker_queue_depth", (("queue", "charlie"),))] == 9
    assert ("charlie_broker_queue_depth", (("queue", "charlie.sweeps"),)) not in got


def test_compactions_and_the_tokens_of_each_model_input_are_counted() -> None:
    """I29: each compaction a transition recorded, with its tokens before and after, and the
    input tokens of each model call (a turn's, a summary's) as the provider counted them."""
    observer, registry = _registry()
    scope = TickScope("x-1", Phase.CALL_MODEL, 3, "w")
    with observer.tick(scope):
        scope.result, scope.to = "moved", Phase.CALL_MODEL
        scope.compactions = (("openai:m", 5200, 1300),)
    observer.model_call(ModelCallEvent("t", "x", 1, "openai:m", 1.0, 2.0, "ok", 4100, 20))
    summary = ModelCallEvent("t", "x", 1, "openai:m", 1.0, 2.0, "ok", 3000, 50, purpose="summary")
    observer.model_call(summary)
    got = _samples(registry)
    model = ("model", "openai:m")
    assert got[("charlie_compactions_total", (model,))] == 1
    assert got[("charlie_compacted_tokens_total", (model, ("when", "before")))] == 5200
    assert got[("charlie_compacted_tokens_total", (model, ("when", "after")))] == 1300
    turn = (model, ("purpose", "turn"))
    assert got[("charlie_model_input_tokens_sum", turn)] == 4100
    assert got[("charlie_model_input_tokens_count", (model, ("purpose", "summary")))] == 1


def test_label_values_are_bounded() -> None:
    labels = _Bounded()
    assert [labels(f"m{i}") for i in range(LABEL_CAP)][-1] == f"m{LABEL_CAP - 1}"
    assert labels("one-more") == "other" and labels("m0") == "m0"
    assert model_label("scripted:/tmp/a b/{x}.json" + "y" * 200) == (
        "scripted:/tmp/a_b/_x_.json" + "y" * 74
    )
    assert tool_label("read_file") == "read_file"  # a built-in
    assert tool_label("../etc/passwd") == "unregistered"


def _dashboard_metric_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query") and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(board)
    assert len(exprs) >= 10, "the dashboard has too few queries"
    return {name for expr in exprs for name in re.findall(r"\bcharlie_[a-z_]+", expr)}


def test_the_dashboard_uses_only_metrics_the_observer_registers() -> None:
    """So the dashboard cannot rot: every charlie_* name in its queries is one the observer
    serves (a family's name with its samples' suffixes)."""
    _, registry = _registry()
    served: set[str] = set()
    for family in registry.collect():  # type: ignore[attr-defined]
        served.add(family.name)
        kind = family.type
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_count", "_sum"),
        }.get(kind, ("",))
        served.update(family.name + suffix for suffix in suffixes)
    used = _dashboard_metric_names()
    assert used - served == set()
    board = json.loads(DASHBOARD.read_text())
    assert any(v.get("type") == "datasource" for v in board["templating"]["list"])
    # every metric the issue asks for is on it
    for name in (
        "charlie_transitions_total",
        "charlie_tool_calls_total",
        "charlie_tool_late_reports_total",
        "charlie_model_calls_total",
        "charlie_tokens_total",
        "charlie_phase_duration_seconds_bucket",
        "charlie_tool_call_duration_seconds_bucket",
        "charlie_runs",
        "charlie_open_tool_calls",
        "charlie_tasks_waiting_for_person",
        "charlie_oldest_stalled_run_seconds",
        "charlie_broker_queue_depth",
    ):
        assert name in used, name


def test_a_taken_port_stops_the_worker_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
        env.update(CHARLIE_HOME=str(tmp_path), CHARLIE_METRICS_PORT=str(port), PYTHONPATH=str(REPO))
        done = subprocess.run(
            [sys.executable, "-m", "charlie", "worker", "--pool", "solo"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr
    assert "CHARLIE_METRICS_PORT" in done.stderr


def _two_free_ports() -> int:
    """A port P from the suite's allocator with P + 1 free too (the beat's default)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_a_worker_and_a_beat_on_one_machine_with_one_port_setting_both_serve(
    tmp_path: Path,
) -> None:
    """Only CHARLIE_METRICS_PORT set: the beat serves on it + 1, the worker on it, and neither
    exits (the beat used to take the workers' port, and the worker then stopped)."""
    port = _two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update(CHARLIE_HOME=str(tmp_path), CHARLIE_METRICS_PORT=str(port), PYTHONPATH=str(REPO))
    started: list[subprocess.Popen[bytes]] = []
    try:
        for args, serving in ((["beat"], port + 1), (["worker", "--pool", "solo"], port)):
            proc = subprocess.Popen(
                [sys.executable, "-m", "charlie", *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            started.append(proc)
            wait_serving([serving], timeout=60)
        assert [p.poll() for p in started] == [None, None]
        beat = {s.name for s in scrape(port + 1)}
        worker = {s.name for s in scrape(port)}
        # each port is its own process's: the beat serves the fleet's gauges, the worker not
        assert any(name.startswith("charlie_") for name in beat)
        assert beat != worker
    finally:
        for proc in started:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# -- through real workers ------------------------------------------------------------------


@pytest.fixture
def metered(cluster: Cluster) -> Cluster:
    with cluster.metered() as metered:
        wait_serving([*metered.worker_metrics_ports(), metered.beat_metrics_port()])
        yield metered


def _final(say: str) -> dict[str, object]:
    return {"say": say, "tool_calls": []}


def _pids(task_ids: list[str]) -> set[str]:
    return {row["worker"] for t in task_ids for row in charlie.history(t)}


def test_metrics_scraped_from_prefork_workers_and_the_beat(metered: Cluster, script) -> None:
    """Counts summed over every pool process of every worker (-c 2), tool outcomes including
    deadline_exceeded, denied and a late report, model calls and tokens by model, durations;
    the beat's gauges and sweep actions. A killed pool process's counts stay."""
    ports = metered.worker_metrics_ports()
    beat = metered.beat_metrics_port()
    before = scrape_all(ports)

    plain = [
        script(
            [
                {
                    "tool_calls": [
                        {
                            "id": "s",
                            "name": "sleep_then",
                            "arguments": {"seconds": 0.05, "value": "a"},
                        },
                        {"id": "b", "name": "boom", "arguments": {"message": "no"}},
                    ]
                },
                _final("done"),
            ]
        )[0]
        for _ in range(4)
    ]
    late_model, _ = script(
        [
            {
                "tool_calls": [
                    {"id": "o", "name": "outlive_deadline", "arguments": {"seconds": 2.5}}
                ]
            },
            _final("too slow"),
        ]
    )
    deny_model, _ = script(
        [
            {"tool_calls": [{"id": "w", "name": "ledger_write", "arguments": {"key": "m1"}}]},
            _final("not writing"),
        ]
    )
    tasks = [charlie.submit("plain", model=m, task_id=tid()) for m in plain]
    late_task = charlie.submit("late", model=late_model, task_id=tid())
    denied = charlie.submit("deny", model=deny_model, task_id=tid(), approve=["ledger_write"])
    everything = [*tasks, late_task, denied]

    # The beat's gauges see the task that waits for an approval.
    wait_for(lambda: charlie.get_task(denied).waiting_for)
    fleet = wait_for(
        lambda: (
            (s := scrape(beat))
            and total(s, "charlie_tasks_waiting_for_person", kind="approval") >= 1
            and s
        ),
        timeout=30,
    )
    assert total(fleet, "charlie_open_tool_calls") >= 1
    assert total(fleet, "charlie_runs", phase="await_tools") >= 1
    assert total(fleet, "charlie_tasks", status="waiting") >= 1
    assert {"phase", "kind", "queue"} <= {k for s in fleet for k in s.labels}
    assert any(s.name == "charlie_broker_queue_depth" for s in fleet)
    assert any(s.name == "charlie_oldest_stalled_run_seconds" for s in fleet)
    charlie.deny(denied, "w", "not today")

    for task_id in everything:
        info = charlie.wait(task_id, timeout=60)
        assert info.status is TaskStatus.SUCCEEDED, info.error
    # The late report: the handler ends 2.5 s after it started, past its 1 s deadline.
    after = wait_for(
        lambda: (
            (s := scrape_all(ports))
            and total(s, "charlie_tool_late_reports_total", tool="outlive_deadline") >= 1
            and s
        ),
        timeout=30,
    )

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # Transitions: every one the database recorded for these tasks, counted wherever it ran.
    recorded = Counter(
        (row["from_phase"], row["to_phase"])
        for t in everything
        for row in charlie.history(t)
        if row["from_phase"] != row["to_phase"]
    )
    assert len(_pids(everything)) >= 2, "the runs all went through one pool process"
    for (phase, to), count in recorded.items():
        assert delta("charlie_transitions_total", phase=phase, to=to) >= count, (phase, to)
    assert delta("charlie_ticks_total", phase="call_model", result="moved") >= 2 * len(everything)

    # Tool calls by outcome, once each as they entered the transcript, whoever settled them.
    assert delta("charlie_tool_calls_total", tool="sleep_then", outcome="ok") >= 4
    assert delta("charlie_tool_calls_total", tool="boom", outcome="error") >= 4
    assert (
        delta("charlie_tool_calls_total", tool="outlive_deadline", outcome="deadline_exceeded") >= 1
    )
    assert delta("charlie_tool_calls_total", tool="ledger_write", outcome="denied") >= 1
    assert delta("charlie_tool_call_duration_seconds_count", tool="sleep_then") >= 4

    # Models: calls and tokens by model (each script is a model of its own).
    for model in [*plain, late_model, deny_model]:
        label = model_label(model)
        assert delta("charlie_model_calls_total", model=label, outcome="ok") == 2, label
        assert delta("charlie_tokens_total", model=label, kind="output") > 0
        assert delta("charlie_model_call_duration_seconds_count", model=label) == 2
    assert delta("charlie_phase_duration_seconds_count", phase="call_model") >= 12
    assert by(after, "charlie_phase_duration_seconds_bucket", "le", phase="call_model")

    # The beat counted the deadline it settled.
    swept = scrape(beat)
    assert (
        total(swept, "charlie_sweep_actions_total", sweep="sweep.tool_calls", action="deadline")
        >= 1
    )

    # A pool process killed: its counts stay (its files outlive it), the replacement adds on.
    pool_pids = {int(w.rsplit(":", 1)[1]) for w in _pids(everything)}
    victim = next(p for p in pool_pids if p not in {w.pid for w in metered.workers})
    counted = total(scrape_all(ports), "charlie_transitions_total")
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{victim}").exists(), timeout=10)
    assert total(scrape_all(ports), "charlie_transitions_total") >= counted


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_metrics_from_a_worker_without_pool_processes(cluster: Cluster, script, pool: str) -> None:
    """--pool threads and solo run the tasks in the worker's main process: it counts too."""
    with cluster.metered(pool=pool) as metered:
        ports = metered.worker_metrics_ports()
        wait_serving(ports)
        before = scrape_all(ports)
        model, _ = script(
            [
                {
                    "tool_calls": [
                        {"name": "sleep_then", "arguments": {"seconds": 0.01, "value": "a"}}
                    ]
                },
                _final("done"),
            ]
        )
        task_id = charlie.submit("plain", model=model, task_id=tid())
        info = charlie.wait(task_id, timeout=60)
        assert info.status is TaskStatus.SUCCEEDED, info.error
        after = scrape_all(ports)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("charlie_transitions_total", phase="report_terminal", to="done") >= 1
    assert delta("charlie_tool_calls_total", tool="sleep_then", outcome="ok") >= 1
    assert delta("charlie_model_calls_total", model=model_label(model), outcome="ok") == 2


def test_model_calls_count_their_cost_from_the_price_table() -> None:
    from charlie.pricing import Price

    observer, registry = _registry()
    observer.prices = {"openai:gpt-4.1": Price(input=2.0, output=8.0)}
    observer.model_call(ModelCallEvent("t", "x", 1, "openai:gpt-4.1", 1.0, 2.0, "ok", 1000, 500))
    observer.model_call(ModelCallEvent("t", "x", 1, "openai:unpriced", 1.0, 2.0, "ok", 1000, 5))
    samples = _samples(registry)
    cost = samples[("charlie_cost_usd_total", (("model", "openai:gpt-4.1"),))]
    assert cost == pytest.approx((1000 * 2.0 + 500 * 8.0) / 1_000_000)
    assert ("charlie_cost_usd_total", (("model", "openai:unpriced"),)) not in samples


def test_prompt_cache_tokens_are_counted_and_priced_at_their_rates() -> None:
    from charlie.pricing import Price

    observer, registry = _registry()
    observer.prices = {"anthropic:c": Price(3.0, 15.0, cache_read=0.3, cache_write=3.75)}
    observer.model_call(
        ModelCallEvent(
            "t", "x", 1, "anthropic:c", 1.0, 2.0, "ok", 1000, 10,
            cache_read_tokens=600, cache_write_tokens=300,
        )
    )  # fmt: skip
    samples = _samples(registry)
    label = (("kind", "cache_read"), ("model", "anthropic:c"))
    assert samples[("charlie_tokens_total", label)] == 600
    cost = samples[("charlie_cost_usd_total", (("model", "anthropic:c"),))]
    assert cost == pytest.approx((100 * 3 + 600 * 0.3 + 300 * 3.75 + 10 * 15) / 1_000_000)
