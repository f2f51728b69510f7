"""The table: every figure's rows in the order printed, what is derived from them, and the
footnotes and machine line around them.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from typing import Any

from benchmarks import (
    console,
    dbos,
    fanout,
    fleet,
    growth,
    inflight,
    limits,
    longrun,
    recovery,
    scale,
    streaming,
    transitions,
    waiting,
)
from benchmarks.growth import GROWTH_FIGURES
from benchmarks.harness import NONE, RANGE, REPO, Row, Sizes, percentile
from benchmarks.streaming import STREAM_URLS

#: every row of the table, in the order printed: each figure module holds its own
ROWS: list[Row | str] = [
    *transitions.ROWS,
    *dbos.ROWS,
    *fanout.ROWS,
    *recovery.ROWS,
    *scale.ROWS,
    *longrun.ROWS,
    *scale.MEMORY_ROWS,
    *waiting.ROWS,
    *streaming.ROWS,
    *limits.ROWS,
    *inflight.ROWS,
    *fleet.ROWS,
    *console.ROWS,
    *growth.ROWS,
]


def cell_text(values: list[float] | None, row: Row) -> str:
    if not values:
        return NONE
    if row.kind == "all":
        return " / ".join(f"{v:,.{row.digits}f}" for v in values)
    if row.kind in ("p50", "p95"):
        v = percentile(values, 0.5 if row.kind == "p50" else 0.95)
        return f"{v:.{row.digits}f} (n={len(values)})"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:,.{row.digits}f}"
    d = row.digits
    return f"{mid:,.{d}f} ({min(values):,.{d}f}{RANGE}{max(values):,.{d}f})"


def derive(values: dict[str, list[float]]) -> None:
    for _, name in GROWTH_FIGURES:
        small, large = values.get(f"growth.small.{name}"), values.get(f"growth.large.{name}")
        if small and large:
            values[f"growth.ratio.{name}"] = [statistics.median(large) / statistics.median(small)]
    many = values.get("many.tps")
    if many and values.get("scale.tps"):
        values["scale.vs_many"] = [v / statistics.median(many) for v in values["scale.tps"]]
    # Waiting: the runs without the N waiting are all measured before they are submitted, so
    # the ratios are of the medians, not trial by trial.
    for ratio, base, held in (
        ("waiting.turn_ratio", "wait_base_one.turn_ms", "wait_with_one.turn_ms"),
        ("waiting.tps_ratio", "wait_base_many.tps", "wait_with_many.tps"),
        ("waiting.turn_ratio_analyzed", "wait_base_one.turn_ms", "wait_analyzed_one.turn_ms"),
        ("waiting.tps_ratio_analyzed", "wait_base_many.tps", "wait_analyzed_many.tps"),
    ):
        if values.get(base) and values.get(held):
            values[ratio] = [statistics.median(values[held]) / statistics.median(values[base])]
    # Streaming: off and on interleave trial by trial, so the ratios are too.
    off = values.get("stream_off.turn_ms")
    for name in STREAM_URLS:
        on = values.get(f"stream_{name}.turn_ms")
        if off and on:
            values[f"stream_{name}.turn_ratio"] = [b / a for a, b in zip(off, on, strict=False)]


def render(
    results: dict[str, dict[str, Any]],
    labels: dict[str, str],
    skipped: dict[str, str],
    command: str,
    sizes: Sizes,
    worker_env: list[str],
    version: str,
) -> str:
    names = list(results)
    out = [f"Command: `{command}`  ", f"Charlie: {version}  ", machine_line(results), ""]
    out.append(
        f"Trials: {sizes.trials} (median, min{RANGE}max); 1 run of {sizes.turns_one} turns; "
        f"{sizes.runs_many} runs of {sizes.turns_many} turns; floor chains of {sizes.links_one} "
        f"and {sizes.runs_many} x {sizes.links_many} links; fan-out of {sizes.fanout_calls}; "
        f"{sizes.recovery_samples} recovery samples; scale {sizes.scale_tasks:,} tasks; "
        f"N = {sizes.waiting_tasks:,} waiting tasks, batch of {sizes.waiting_runs} runs of "
        f"{sizes.waiting_turns} turns; console: a run of about {sizes.console_items:,} "
        f"transcript items, a list over {sizes.console_tasks:,} tasks; in flight: "
        f"{sizes.inflight_tasks:,} tasks (prefork: {sizes.inflight_prefork}) of 2 model calls "
        f"of {sizes.inflight_latency:g} s; fleet: {sizes.fleet_runs} runs of "
        f"{sizes.fleet_turns} turns."
    )
    out.append("")
    if names:
        out.append("| Metric | " + " | ".join(labels[n] for n in names) + " | Target |")
        out.append("|---|" + "---:|" * len(names) + "---|")
        heading = ""
        for row in ROWS:
            if isinstance(row, str):
                heading = f"| {row} |" + " |" * len(names) + " |"
                continue
            cells = [cell_text(results[n]["values"].get(row.key), row) for n in names]
            if all(c == NONE for c in cells):
                continue
            if heading:  # a section's heading, once it has a row to show
                out.append(heading)
                heading = ""
            out.append(f"| {row.label} | " + " | ".join(cells) + f" | {row.target} |")
    out.append("")
    out += FOOTNOTES
    for name in names:
        if "settings" in results[name]["info"]:
            out.append(f"- {labels[name]}: Charlie ran with {results[name]['info']['settings']}.")
    if worker_env:
        out.append(f"- Not the default configuration: workers ran with {' '.join(worker_env)}.")
    for name, reason in skipped.items():
        out.append(f"- {labels[name]}: skipped: {reason}")
    measured = [results[n]["info"]["dbos"] for n in names if "dbos" in results[n]["info"]]
    if measured:
        out.append(
            f"- DBOS {measured[0]}: one workflow per run, its steps returning at once; DBOS runs "
            "in a process of its own (no broker, no worker pool), checkpointing each step "
            "in PostgreSQL. Per turn: the workflow's time / its turns. In the in-flight and "
            "fleet rows the workflows are enqueued at once on a DBOS queue (polled every "
            "second, DBOS's default). Taken in pairs: after each trial, one DBOS process "
            "serves a workflow of the single run's turns on request, alternated with a Charlie "
            "run of the same turns (each run a second or less apart, the order swapped each "
            "pair); Charlie's time runs from the submit to its last transition, DBOS's is its "
            "workflow call's; a trial's figure is the median of its pairs' ratios."
        )
    else:
        out.append(
            "- DBOS: not measured (`--dbos-python` names an interpreter with `pip install dbos`, "
            "or install it here); skipped."
        )
    for name in names:
        for note in results[name]["notes"]:
            out.append(f"- {labels[name]}: {note}")
        info = results[name]["info"]
        for size in ("small", "large"):
            if f"growth.{size}.seq_scans" in info:
                scans = info[f"growth.{size}.seq_scans"]
                out.append(
                    f"- {labels[name]}: growth, {size}: sequential scans of Charlie's tables in "
                    "the plans (EXPLAIN) of the statements measured: "
                    + ("; ".join(scans) if scans else "none")
                    + f"; `charlie doctor` exited {info.get(f'growth.{size}.doctor_exit')}"
                )
            if info.get(f"growth.{size}.sweep_statements"):
                out.append(
                    f"- {labels[name]}: growth, {size}: a sweep round's costliest statements "
                    "(ms a round): " + "; ".join(info[f"growth.{size}.sweep_statements"])
                )
    return "\n".join(out)


FOOTNOTES = [
    "- Targets are the project's, for PostgreSQL + Redis with 2 worker processes.",
    "- A transition is a row of Charlie's `transitions` table (a turn is 4: call_model, "
    "dispatch_tools, await_tools, advance_turn); a floor link locks, updates and commits one "
    "row and publishes the next link. Ratios are taken trial by trial.",
    "- Per-turn overhead and fan-out: from the commit of the model's response to the start of "
    "the next model call's tick (its transition time minus its duration).",
    "- SQL statements are counted inside the workers with a `before_cursor_execute` listener: "
    "on SQLite they include `BEGIN IMMEDIATE`/`DEFERRED`; on PostgreSQL BEGIN and COMMIT are not"
    " statements. Sweeps are left out.",
    "- Recovery: the worker (main process and pool) is SIGKILLed at a random moment while two "
    "model calls are in flight, and a new one started at once, with beat running and the "
    "default lease and sweep settings (below). 'Moving again' is the start of the retried "
    "call_model tick.",
    "- Scale: the tasks are queued with the worker stopped, then a fresh worker drains them; "
    "rates are over the window from the first to the last transition.",
    "- RSS is summed over the worker's process group (shared pages counted in each process).",
    "- Waiting (I25): N tasks whose first turn calls a tool on their `approve` list. With all "
    "N `waiting` and the broker queue drained, the workers are watched idle; then the 1-run and "
    "batch measurements are run again (the ones without were run before the N were submitted; "
    "ratios are of medians). Leases, calls and statuses are sampled every 0.5 s meanwhile; a "
    "sweep re-publish is a `swept_at` set on their run or call, or a line of beat's log. Scans: "
    "beat's read-only queries for due work, one round, median of 10. On PostgreSQL the scans, "
    "and but for `--quick` the runs with the N waiting, are measured again after an ANALYZE "
    "(what autovacuum does to a fresh database). Then every held call is approved "
    "(`charlie.approve`, one at a time) and the N run to their final answer; an approved "
    "call's deadline (the tool's, 60 s) runs from its approve, its wait in the queue included.",
    "- Many agents per worker: each task's model calls go to a real HTTP server on 127.0.0.1 "
    "that answers after the latency and counts its requests in flight (the peak is its count); "
    "the ideal is ceil(N / the worker's slots) x 2 calls x the latency; the wall runs from the "
    "first submit to the last transition. The worker's RSS is summed over its process group, the "
    "most of samples every 0.5 s; DBOS's is its process's peak (ru_maxrss).",
    "- Fleet: WAL bytes are the whole server's (`pg_current_wal_lsn` before the submits and "
    "after the last run ends): on a shared server, other databases' writes count too.",
    "- Console: times are the client's, over loopback, 50 tasks a list page; the task page is "
    "its header, open calls, actions, the timeline SVG of the whole run and the latest 300 "
    "transcript rows (a call's whole record loads when its row is opened); `?all=1` has every "
    "row. In Chromium, 'usable' is the navigation's load event (HTML parsed, "
    "style and script loaded, the live poll started). The list's tasks are inserted with SQL, "
    "a tenth of them failed, canceled, waiting or running; the search matches about 1 in 97.",
]


def code_version() -> str:
    """The commit measured, and whether the code differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "charlie", "celeryconfig.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown commit"
    if not head:
        return "unknown commit"
    return f"commit {head}" + (" with uncommitted changes to charlie/" if dirty else "")


def machine_line(results: dict[str, dict[str, Any]]) -> str:
    from importlib.metadata import version

    servers: dict[str, str] = {}
    for r in results.values():
        servers.update(r["info"].get("versions", {}))
    parts = [
        f"nproc {os.cpu_count()}",
        f"{platform.system()} {platform.machine()}",
        f"Python {platform.python_version()}",
        f"Celery {version('celery')}",
        f"kombu {version('kombu')}",
        f"SQLAlchemy {version('sqlalchemy')}",
    ]
    parts += [f"{k} {v}" for k, v in sorted(servers.items())]
    return "Machine: " + ", ".join(parts)
