"""Run the demo: start a worker (with beat) on the embedded default, submit, follow, report."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import click

from charlie import api
from charlie.config import settings
from charlie.views import transcript_rows

HERE = Path(__file__).parent
PROMPT = (
    "The 2.4 configuration change broke parsing of existing config files. Find the regression "
    "in the confparse repository, fix it without losing the new behaviour, and prove it with "
    "the test suite."
)


def _start_worker(home: Path) -> subprocess.Popen[bytes]:
    with open(home / "demo-worker.log", "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "charlie",
                "worker",
                "-c",
                "2",
                "-B",
                "--schedule",
                str(home / "demo-beat-schedule"),
                "--loglevel",
                "WARNING",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ.copy(),
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # TERM to the main process only: it shuts its pool down; signalling the whole group
        # makes the children die under it and the warm shutdown wait for them.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_demo(timeout: float = 120.0) -> int:
    s = settings()
    s.home.mkdir(parents=True, exist_ok=True)
    task_id = f"demo-{uuid.uuid4().hex[:8]}"
    workspace = s.home / "demo" / task_id / "confparse"
    shutil.copytree(HERE / "sample_repo", workspace)
    click.echo(
        f"Charlie demo — home {s.home}, database {s.database_url.split('://')[0]}, "
        f"broker {s.broker_url.split('://')[0]}"
    )
    click.echo(f"workspace: {workspace}")
    worker = _start_worker(s.home)
    try:
        api.submit(
            PROMPT,
            model=f"scripted:{HERE / 'script.json'}",
            task_id=task_id,
            metadata={"workspace": str(workspace)},
            timeout=timeout,
        )
        click.echo(f"task {task_id} submitted\n")
        shown = -1
        deadline = time.monotonic() + timeout + 10
        while time.monotonic() < deadline:
            for seq, line in transcript_rows(task_id, after_seq=shown):
                click.echo(line)
                shown = seq
            info = api.get_task(task_id)
            if info.terminal:
                break
            if worker.poll() is not None:
                click.echo("the worker exited; see demo-worker.log", err=True)
                return 1
            time.sleep(0.2)
        for _, line in transcript_rows(task_id, after_seq=shown):
            click.echo(line)
        info = api.get_task(task_id)
        elapsed = (info.finished_at - info.created_at).total_seconds() if info.finished_at else None
        click.echo(
            f"\ntask {task_id}: {info.status.value}"
            + (f" in {elapsed:.1f} s" if elapsed is not None else "")
            + f" — {info.model_calls} model calls, phase {info.phase}"
        )
        click.echo(f"inspect it again with: charlie show {task_id}")
        return 0 if info.status.value == "succeeded" else 1
    finally:
        _stop(worker)
