"""Commands run in a sandbox: a command the model asked for cannot read the
worker's or the devbox's secrets, Charlie's state or other workspaces, nor reach the network
unless its task allows it; where no sandbox can run, commands are refused unless the operator
opted out explicitly."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.sandbox import SandboxPolicy, wrap
from tests.devbox.cluster_support import DevboxProcess
from tests.support.cluster import FAKE_MODEL_KEY, REPO, SANDBOX_PROBLEM, Cluster, free_port
from tests.support.needs import need


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    need(SANDBOX_PROBLEM, "no sandbox here")


PROBE = """
echo "environ:"; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'
echo "processes: $(ls -d /proc/[0-9]* | wc -l)"
echo "home: $(find "$1" -type f 2>&1 | head -5)"
echo "other: $(cat "$2" 2>&1)"
python3 net.py "$3" 2>/dev/null || echo "net: closed"
echo written > inside.txt
"""


NET = """
import socket, sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), 2)
print("net: open")
"""


@contextlib.contextmanager
def _listening() -> Iterator[int]:
    """A port on loopback that accepts connections (the kernel completes them from the
    backlog), standing for the database, the broker or a model server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def _probe_task(script: Any, workspace: Path, args: list[str], metadata: dict[str, Any]) -> str:
    (workspace / "probe.sh").write_text(PROBE)
    (workspace / "net.py").write_text(NET)
    command = "sh probe.sh " + " ".join(args)
    model, _ = script(
        [
            {
                "say": "probe",
                "tool_calls": [
                    {"id": "p", "name": "run_command", "arguments": {"command": command}}
                ],
            },
            {"say": "done"},
        ]
    )
    task_id = charlie.submit(
        "probe", model=model, metadata={"workspace": str(workspace), **metadata}
    )
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok", result.payload
    return str(result.payload["result"]["stdout"])


def test_local_run_command_sees_no_secret_no_state_no_network(
    cluster: Cluster, script: Any, workspace: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-task" / "secret.txt"
    other.parent.mkdir()
    other.write_text("another task's file")
    home = cluster.settings_env["CHARLIE_HOME"]
    with _listening() as port:
        out = _probe_task(script, workspace, [home, str(other), str(port)], {})
    # the worker's environment holds the model key and the database URL: none of it is visible
    assert FAKE_MODEL_KEY not in out
    assert "CHARLIE_" not in out
    assert int(out.split("processes: ")[1].split()[0]) < 10  # its own pid namespace
    # Charlie's home holds no file (at most the empty mount points of what it hides)
    assert "home: \n" in out or "home: find:" in out, out
    assert "another task's file" not in out
    assert "net: closed" in out
    assert (workspace / "inside.txt").read_text() == "written\n"


def test_a_task_with_the_network_still_cannot_reach_loopback(
    cluster: Cluster, script: Any, workspace: Path, tmp_path: Path
) -> None:
    """A task allowed the network gets its own network namespace behind a user-mode stack:
    the database, the broker and the devbox on the host's loopback stay out of reach
    (tests/integration/test_sandbox_network.py shows what it does reach)."""
    with _listening() as port:
        out = _probe_task(
            script,
            workspace,
            ["/nonexistent", "/nonexistent", str(port)],
            {"sandbox": {"network": True}},
        )
    assert "net: closed" in out


def test_devbox_commands_see_no_token_and_no_other_workspace(tmp_path: Path) -> None:
    from charlie.devbox import DevboxClient, DevboxError

    box = DevboxProcess(tmp_path / "devbox", tmp_path / "devbox.log")
    try:
        with DevboxClient(box.url, box.token) as client:
            client.ensure_workspace("a", None)
            client.ensure_workspace("b", None)
            client.write_file("b", "secret.txt", "b's secret")
            b_path = client.ensure_workspace("b", None).path
            started = client.start_command(
                "a",
                shell=(
                    "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; "
                    f"cat {b_path}/secret.txt 2>&1; ls {box.root} 2>&1; ls -d /proc/[0-9]* | wc -l"
                ),
            )
            status = client.wait_command(started.execution_id, timeout=30)
            assert status.exit_code == 0, status
            out = status.stdout_tail
            assert box.token not in out
            assert "b's secret" not in out
            assert int(out.strip().splitlines()[-1]) < 10
            # the network only where the devbox allows it
            with pytest.raises(DevboxError) as refused:
                client.start_command("a", shell="true", network=True)
            assert refused.value.status == 403
            assert "--allow-network" in refused.value.message
    finally:
        box.kill()


def _without_bwrap_env() -> dict[str, str]:
    # a PATH with the interpreter and git but no bwrap
    bindir = Path(sys.executable).parent
    return {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")} | {
        "PATH": f"{bindir}:/nonexistent",
        "PYTHONPATH": str(REPO),
    }


def test_without_a_sandbox_commands_are_refused_unless_opted_out(tmp_path: Path) -> None:
    probe = (
        "from charlie.sandbox import check_mode, SandboxUnavailable\n"
        "try:\n    check_mode('bwrap')\nexcept SandboxUnavailable as e:\n    print(e)\n"
        "check_mode('off')\nprint('opted out: ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_without_bwrap_env(), capture_output=True, text=True
    )
    assert "commands are refused: no sandbox (bubblewrap is not installed" in done.stdout
    assert "CHARLIE_SANDBOX=off" in done.stdout
    assert "opted out: ok" in done.stdout
    served = subprocess.run(
        [sys.executable, "-m", "charlie.devbox", "serve", "--port", str(free_port())],
        env=_without_bwrap_env()
        | {"CHARLIE_DEVBOX_TOKEN": "t" * 32, "CHARLIE_DEVBOX_ROOT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert served.returncode != 0
    assert "refusing to start" in served.stderr and "--no-sandbox" in served.stderr


def test_wrap_hides_home_secrets_but_keeps_the_interpreter(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    argv = wrap(
        [sys.executable, "-c", "import sys, os; print(os.getcwd())"],
        SandboxPolicy(workspace=ws),
        cwd=ws,
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ws.resolve())


def test_other_workspace_roots_and_an_sqlite_file_elsewhere_are_hidden(tmp_path: Path) -> None:
    """The sandbox hides every workspace root (other tasks'
    workspaces) and an SQLite database kept outside Charlie's home, not only the home."""
    from dataclasses import replace

    from charlie.config import load_settings
    from charlie.tools.builtins import _charlie_state

    # outside /tmp, which the sandbox hides anyway
    base = Path.home() / f".charlie-sandbox-test-{uuid.uuid4().hex[:8]}"
    try:
        (base / "roots" / "a").mkdir(parents=True)
        (base / "roots" / "b").mkdir(parents=True)
        (base / "roots" / "b" / "secret.txt").write_text("b's secret")
        db = base / "state" / "charlie.db"
        db.parent.mkdir()
        db.write_text("every prompt")
        s = replace(
            load_settings(),
            home=base / "home",
            workspace_roots=(base / "roots",),
            database_url=f"sqlite:///{db}",
        )
        probe = f"cat {base}/roots/b/secret.txt; cat {db}; echo end"
        argv = wrap(
            ["/bin/sh", "-c", probe],
            SandboxPolicy(workspace=base / "roots" / "a", hidden=_charlie_state(s)),
        )
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert "end" in done.stdout, done.stderr
        assert "b's secret" not in done.stdout
        assert "every prompt" not in done.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_write_file_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    """A command can plant a symlink in the workspace at any name; write_file's temporary
    file must not follow it out of the workspace."""
    from charlie.testing import ToolEnvironment

    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    ws = tmp_path / "ws"
    ws.mkdir()
    # the name the old implementation used for its temporary file
    (ws / ".x.charlie-tmp").symlink_to(outside)
    env = ToolEnvironment(workspace=ws)
    outcome = env.run("write_file", path="x", content="payload")
    assert outcome.outcome.value == "ok", outcome
    assert (ws / "x").read_text() == "payload"
    assert outside.read_text() == "untouched"


def test_a_local_command_stops_when_its_lease_is_lost(tmp_path: Path) -> None:
    """Once the keeper sees the call's lease lost (another worker took it
    over), the local run_command ends its command instead of running on for the old holder."""
    import threading

    from charlie.tools.builtins import run_command
    from charlie.tools.context import LeaseLost, ToolContext

    ws = tmp_path / "ws"
    ws.mkdir()
    ctx = ToolContext(
        task_id="t",
        execution_id="x-t",
        call_id="c",
        turn=0,
        workspace=ws,
        metadata={},
        resumed=False,
        handle=None,
        _record_handle=lambda _h: None,
    )
    threading.Timer(0.5, ctx.lease_lost.set).start()
    with pytest.raises(LeaseLost):
        run_command("touch started; sleep 3; touch finished", ctx, timeout=60)
    assert (ws / "started").exists()
    time.sleep(3.5)
    assert not (ws / "finished").exists(), "the command ran on after its lease was lost"
