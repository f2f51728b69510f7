"""A command cannot race the file tools out of the workspace (I33).

The race itself: a command run in the real sandbox (bubblewrap) exchanges, in a tight loop with
``renameat2(RENAME_EXCHANGE)``, a directory of the workspace with a symlink to ``/proc/self``
and another with a symlink to a directory outside, while thousands of reads, writes and
listings go through the local tools (and the tool SDK's ``ctx``) and through the devbox's
Workspaces over HTTP. A path checked first and opened by name after reads the process's own
environment (the devbox's token, the worker's database URL) and writes outside; opened beneath
the workspace's descriptor it never does.

No timing is asserted: the command races until the test, done with its operations, asks it to
stop (a file), and the operations are counted, not timed.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import beneath
from charlie.devbox import DevboxClient, DevboxServer, Limits
from charlie.devbox.client import DevboxError
from charlie.domain import TaskStatus
from charlie.tools.builtins import list_files, read_file, run_command, write_file
from charlie.tools.context import ToolContext, ToolError
from tests.conftest import wait_for
from tests.support.cluster import SANDBOX_PROBLEM, TEST_SANDBOX, Cluster
from tests.support.needs import need

#: Exchanges each pair of names (a directory and a symlink) until the file ``stop`` appears.
RACER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
pairs = [(a.encode(), b.encode()) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]
AT_FDCWD, RENAME_EXCHANGE = -100, 2
open("racing", "w").close()
n, give_up = 0, time.monotonic() + 120  # (a bound on a test that died, not a timing)
while not os.path.exists("stop") and time.monotonic() < give_up:
    for _ in range(500):
        for a, b in pairs:
            if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
                sys.exit("renameat2 failed: errno %d" % ctypes.get_errno())
    n += 500
print("exchanged", n)
"""

#: what each directory holds inside the workspace, and what the same names hold outside
INSIDE_D = "inside the workspace: d"
INSIDE_W = "inside the workspace: w"
OUTSIDE = "OUTSIDE THE WORKSPACE"

#: operations per kind, each through the race
READS = 1500
WRITES = 500
LISTS = 200


@dataclass
class Tally:
    ops: Counter[str] = field(default_factory=Counter)
    escapes: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)

    def escaped(self, kind: str, what: object) -> None:
        self.escapes[kind] += 1
        if len(self.samples) < 5:
            self.samples.append(f"{kind}: {str(what)[:80]!r}")

    def report(self) -> str:
        return f"ops {dict(self.ops)}, escapes {dict(self.escapes)}, e.g. {self.samples}"


def _seed(ws: Path, outside: Path) -> None:
    """``d`` (a directory) beside ``p`` (a link to /proc/self), ``w`` beside ``o`` (a link to a
    directory outside the workspace, holding what ``w`` holds under the same name)."""
    (ws / "d").mkdir()
    (ws / "d" / "environ").write_text(INSIDE_D)
    (ws / "p").symlink_to("/proc/self")
    (ws / "w").mkdir()
    (ws / "w" / "secret.txt").write_text(INSIDE_W)
    outside.mkdir()
    (outside / "secret.txt").write_text(OUTSIDE)
    (outside / "only-outside.txt").write_text(OUTSIDE)
    (ws / "o").symlink_to(outside)
    (ws / "racer.py").write_text(RACER)


def _wait_for(path: Path, racer: threading.Thread | None = None) -> None:
    """Until the racer says it races (a file it makes), or it ended without racing."""
    import time

    end = time.monotonic() + 60
    while not path.exists():
        if (racer is not None and not racer.is_alive()) or time.monotonic() > end:
            raise AssertionError("the racing command never started")
        time.sleep(0.02)


def _race(
    tally: Tally,
    read: Callable[[str], Any],
    write: Callable[[str, str], Any],
    listing: Callable[[str], list[str]],
    refused: tuple[type[BaseException], ...],
) -> None:
    """The operations, interleaved; each one refused, or answered from inside the workspace."""
    for i in range(READS):
        path, inside = ("d/environ", INSIDE_D) if i % 2 == 0 else ("w/secret.txt", INSIDE_W)
        try:
            got = read(path)
            tally.ops["read"] += 1
            if got != inside:
                tally.escaped("read", got)
        except refused:
            tally.ops["read refused"] += 1
        if i % 3 == 0 and (j := i // 3) < WRITES:
            try:
                write(f"w/new-{j}.txt", "written through the race")
                tally.ops["write"] += 1
            except refused:
                tally.ops["write refused"] += 1
        if i % 7 == 0 and i // 7 < LISTS:
            try:
                names = listing("d" if i % 2 == 0 else "w")
                tally.ops["list"] += 1
            except refused:
                tally.ops["list refused"] += 1
                continue
            stray = [n for n in names if n not in ("environ", "secret.txt") and "new-" not in n]
            if stray:
                tally.escaped("list", stray)


def _outside_untouched(tally: Tally, outside: Path) -> None:
    for extra in sorted(set(os.listdir(outside)) - {"secret.txt", "only-outside.txt"}):
        tally.escaped("write", extra)
    if (outside / "secret.txt").read_text() != OUTSIDE:
        tally.escaped("write", "secret.txt overwritten")


# -- the local tools and the tool SDK --------------------------------------------------------


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ToolContext("t", "x-t", "c", 0, ws, {}, False, None, lambda _h: None)


@pytest.fixture
def racing_locally(ctx: ToolContext, tmp_path: Path) -> Iterator[Path]:
    """The racer, run through the local run_command tool in the real sandbox."""
    need(SANDBOX_PROBLEM, "no sandbox here")
    outside = tmp_path / "outside"
    _seed(ctx.workspace, outside)
    done: dict[str, Any] = {}

    def race() -> None:
        try:
            done["result"] = run_command("python3 racer.py d p w o", ctx, timeout=600)
        except ToolError as exc:
            done["result"] = exc.as_result()

    racer = threading.Thread(target=race, daemon=True)
    racer.start()
    try:
        _wait_for(ctx.workspace / "racing", racer)
        yield outside
    finally:
        (ctx.workspace / "stop").touch()
        racer.join(60)
    result = done.get("result") or {}
    assert "exchanged" in str(result.get("stdout")), result


@pytest.mark.backend_free
@pytest.mark.parametrize("way", ["openat2", "walk"])
def test_local_tools_are_not_raced_out_of_the_workspace(
    ctx: ToolContext, racing_locally: Path, way: str
) -> None:
    """Through the kernel's openat2 and through the component walk of a kernel without it."""
    tally = Tally()
    beneath.force_walk(way == "walk")
    try:
        _race_tools(ctx, tally)
    finally:
        beneath.force_walk(False)
    _outside_untouched(tally, racing_locally)
    print(tally.report())
    assert not tally.escapes, tally.report()


def _race_tools(ctx: ToolContext, tally: Tally) -> None:

    def listing(path: str) -> list[str]:
        return [os.path.basename(n) for n in list_files(ctx, path)]

    _race(
        tally,
        lambda path: read_file(path, ctx),
        lambda path, text: write_file(path, text, ctx),
        listing,
        (ToolError,),
    )


@pytest.mark.backend_free
def test_the_tool_sdks_openers_are_not_raced_out_of_the_workspace(
    ctx: ToolContext, racing_locally: Path
) -> None:
    """A user tool's ``ctx.open`` / ``read_text`` / ``write_text`` / ``listdir``."""
    tally = Tally()
    _race(tally, ctx.read_text, ctx.write_text, ctx.listdir, (ToolError, OSError))
    _outside_untouched(tally, racing_locally)
    print(tally.report())
    assert not tally.escapes, tally.report()


# -- the devbox --------------------------------------------------------------------------------

TOKEN = "test-devbox-token-0123456789abcdef"


@pytest.mark.backend_free
def test_devbox_files_are_not_raced_out_of_the_workspace(tmp_path: Path) -> None:
    need(SANDBOX_PROBLEM, "no sandbox here")
    server = DevboxServer(tmp_path / "devbox", TOKEN, limits=Limits(sandbox=TEST_SANDBOX)).start()
    try:
        with DevboxClient(server.url, TOKEN) as client:
            client.ensure_workspace("ws", None)
            ws = Path(client.get_workspace("ws").path)
            outside = tmp_path / "outside"
            _seed(ws, outside)
            started = client.start_command("ws", ["python3", "racer.py", "d", "p", "w", "o"])
            tally = Tally()
            try:
                _wait_for(ws / "racing")
                _race(
                    tally,
                    lambda path: client.read_file("ws", path).content,
                    lambda path, text: client.write_file("ws", path, text),
                    lambda path: [e.name for e in client.list_files("ws", path)],
                    (DevboxError,),
                )
            finally:
                (ws / "stop").touch()
                status = client.wait_command(started.execution_id, timeout=60)
            assert status.done and "exchanged" in status.stdout_tail, status
    finally:
        server.stop()
    _outside_untouched(tally, outside)
    print(tally.report())
    assert not tally.escapes, tally.report()


# -- through a real task ------------------------------------------------------------------------

#: read_file and write_file calls of the task's one turn, each kind, beside the racing command
TASK_CALLS = 60


# (The race's outcome depends on no database or broker: CI runs it on one backend.)
@pytest.mark.backend_free
def test_a_real_tasks_file_tools_are_not_raced_out_of_its_workspace(
    cluster: Cluster, script: Callable[..., tuple[str, Path]], tmp_path: Path
) -> None:
    """One turn: the racer as a run_command, and beside it reads and writes the cluster's
    workers run in parallel, as a delegated child would beside its parent's command."""
    need(SANDBOX_PROBLEM, "no sandbox here")
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    _seed(ws, outside)
    command = {"command": "python3 racer.py d p w o", "timeout": 600}
    calls: list[dict[str, Any]] = [{"id": "race", "name": "run_command", "arguments": command}]
    for i in range(TASK_CALLS):
        calls += [
            {"id": f"rd{i}", "name": "read_file", "arguments": {"path": "d/environ"}},
            {"id": f"rw{i}", "name": "read_file", "arguments": {"path": "w/secret.txt"}},
            {
                "id": f"w{i}",
                "name": "write_file",
                "arguments": {"path": f"w/new-{i}.txt", "content": "written through the race"},
            },
        ]
    model, _ = script([{"say": "race", "tool_calls": calls}, {"say": "done"}])
    task_id = charlie.submit("race", model=model, metadata={"workspace": str(ws)})
    try:
        _wait_for(ws / "racing")

        def settled() -> bool:
            others = [c for c in charlie.calls(task_id) if c.call_id != "race"]
            return len(others) == 3 * TASK_CALLS and all(c.state == "settled" for c in others)

        wait_for(settled, timeout=300, interval=0.5)
    finally:
        (ws / "stop").touch()
    info = charlie.wait(task_id, timeout=120)
    assert info.status is TaskStatus.SUCCEEDED, info
    tally = Tally()
    for call in charlie.calls(task_id):
        tally.ops[f"{call.name} {call.outcome}"] += 1
        if call.name == "read_file" and call.outcome == "ok":
            inside = INSIDE_D if call.arguments["path"] == "d/environ" else INSIDE_W
            if call.result != inside:
                tally.escaped("read", call.result)
    race = next(c for c in charlie.calls(task_id) if c.call_id == "race")
    assert "exchanged" in str(race.result), race.result
    _outside_untouched(tally, outside)
    print(tally.report())
    assert not tally.escapes, tally.report()
