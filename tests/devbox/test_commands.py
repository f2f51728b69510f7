"""Commands by execution id (I20): detached, pollable by any client, lost across a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from charlie.devbox import CommandPolicy, DevboxClient, DevboxError, DevboxServer, Limits

from .conftest import TOKEN, ServerFactory, ServerProcess, process_gone, wait_until

pytestmark = pytest.mark.timeout(60)

_STARTER = textwrap.dedent(
    """
    import os, sys, time
    from charlie.devbox import DevboxClient
    client = DevboxClient(sys.argv[1], os.environ["DEVBOX_TEST_TOKEN"])
    started = client.start_command("ws", shell="sleep 1; echo done; echo oops >&2; exit 3")
    print(started.execution_id, flush=True)
    time.sleep(60)  # SIGKILLed here, while the command still runs
    """
)


def test_client_killed_new_client_polls_same_execution_id(
    server: DevboxServer, workspace: str
) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, server.url],
        stdout=subprocess.PIPE,
        env={**os.environ, "DEVBOX_TEST_TOKEN": TOKEN},
    )
    assert starter.stdout is not None
    execution_id = starter.stdout.readline().decode().strip()
    starter.send_signal(signal.SIGKILL)
    starter.wait(10)
    starter.stdout.close()
    assert starter.returncode == -signal.SIGKILL

    with DevboxClient(server.url, TOKEN) as fresh:
        assert fresh.command_status(execution_id).status == "running"
        final = fresh.wait_command(execution_id, timeout=15)
    assert final.status == "exited"
    assert final.exit_code == 3
    assert final.stdout_tail == "done\n"
    assert final.stderr_tail == "oops\n"
    assert not final.truncated
    assert final.finished_at is not None


def test_server_killed_running_command_is_lost_after_restart(
    spawn_server: Callable[[], ServerProcess], devbox_root: Path
) -> None:
    first = spawn_server()
    with DevboxClient(first.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        quick = c.start_command("ws", ["echo", "finished"]).execution_id
        assert c.wait_command(quick, timeout=10).status == "exited"
        slow = c.start_command("ws", ["sleep", "30"]).execution_id
        pid = c.command_status(slow).pid
    assert pid is not None and not process_gone(pid)

    first.kill()
    second = spawn_server()
    with DevboxClient(second.url, TOKEN) as c:
        lost = c.command_status(slow)
        done = c.command_status(quick)
    assert lost.status == "lost"
    assert lost.exit_code is None
    assert lost.reason is not None and "restarted" in lost.reason
    # the orphan was killed rather than left to keep changing the workspace
    assert wait_until(lambda: process_gone(pid), timeout=5)
    # a command that finished before the crash keeps its real outcome
    assert (done.status, done.exit_code, done.stdout_tail) == ("exited", 0, "finished\n")
    assert (devbox_root / "commands" / slow / "meta.json").is_file()


def test_graceful_stop_marks_running_command_lost(make_server: ServerFactory) -> None:
    first = make_server()
    with DevboxClient(first.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        execution_id = c.start_command("ws", ["sleep", "30"]).execution_id
    first.stop()
    second = make_server()
    with DevboxClient(second.url, TOKEN) as c:
        status = c.command_status(execution_id)
    assert status.status == "lost"
    assert not status.succeeded


def test_keyed_start_returns_the_first_command_even_after_a_restart(
    make_server: ServerFactory, devbox_root: Path
) -> None:
    """A caller that lost the answer to a start asks again with the same key and gets the same
    command back, never a second run (the window between a start and its id being recorded)."""
    first = make_server()
    with DevboxClient(first.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        c.ensure_workspace("other", None)
        started = c.start_command("ws", shell="echo ran >> count", idempotency_key="call-1")
        again = c.start_command("ws", shell="echo ran >> count", idempotency_key="call-1")
        elsewhere = c.start_command("other", shell="true", idempotency_key="call-1")
        assert c.wait_command(started.execution_id, timeout=10).status == "exited"
    assert started.created and not again.created
    assert again.execution_id == started.execution_id
    assert elsewhere.execution_id != started.execution_id  # keys are per workspace
    first.stop()
    second = make_server()
    with DevboxClient(second.url, TOKEN) as c:
        after = c.start_command("ws", shell="echo ran >> count", idempotency_key="call-1")
        assert (after.execution_id, after.created, after.status) == (
            started.execution_id,
            False,
            "exited",
        )
        with pytest.raises(DevboxError) as bad:
            c.start_command("ws", shell="true", idempotency_key="has space")
    assert bad.value.status == 400
    assert (devbox_root / "workspaces" / "ws" / "count").read_text() == "ran\n"


def test_a_lookup_by_key_never_starts_and_seals_a_key_it_did_not_find(
    client: DevboxClient, workspace: str, devbox_root: Path
) -> None:
    """A resume asks for its command by key: a key that started one finds it;
    a key that did not is sealed, so a start with it that arrives later is refused (409)."""
    started = client.start_command(workspace, shell="echo ran >> count", idempotency_key="k-1")
    found = client.find_command(workspace, "k-1")
    assert found is not None and found.execution_id == started.execution_id and not found.created
    assert client.find_command(workspace, "k-2") is None
    assert client.find_command(workspace, "k-2") is None  # still sealed, still nothing started
    with pytest.raises(DevboxError) as sealed:
        client.start_command(workspace, shell="echo ran >> count", idempotency_key="k-2")
    assert sealed.value.status == 409 and "sealed" in sealed.value.message
    assert client.wait_command(started.execution_id, timeout=10).status == "exited"
    assert (devbox_root / "workspaces" / workspace / "count").read_text() == "ran\n"
    # the workspace need not exist for a lookup (its root may be the thing that was lost)
    assert client.find_command("gone", "k-1") is None


def test_output_beyond_cap_is_dropped_and_says_so(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(output_bytes=1000))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        # 5 MB through a 1000-byte budget: the command must run to the end, not block
        started = c.start_command("ws", shell="head -c 5000000 /dev/zero | tr '\\0' x; echo end")
        status = c.wait_command(started.execution_id, timeout=20)
        short = c.command_status(started.execution_id, tail=100)
    assert (status.status, status.exit_code) == ("exited", 0)
    assert status.truncated
    assert status.stdout_bytes == 5_000_004
    assert status.stdout_tail.endswith("[output truncated at 1000 bytes]\n")
    assert status.stdout_tail.startswith("x" * 1000)
    assert short.stdout_tail.endswith("[output truncated at 1000 bytes]\n")
    on_disk = server.root / "commands" / started.execution_id / "stdout"
    assert on_disk.stat().st_size < 1100


def test_command_timeout_kills_it(client: DevboxClient, workspace: str) -> None:
    began = time.monotonic()
    started = client.start_command(workspace, shell="echo before; sleep 30", timeout=0.5)
    status = client.wait_command(started.execution_id, timeout=10)
    assert status.status == "timed_out"
    assert status.stdout_tail == "before\n"
    assert time.monotonic() - began < 5
    assert status.pid is not None and wait_until(lambda: process_gone(status.pid or 0))


def test_request_cannot_raise_the_timeout(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(command_timeout=0.5))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        started = c.start_command("ws", ["sleep", "30"], timeout=1000)
        assert started.timeout == 0.5
        assert c.wait_command(started.execution_id, timeout=10).status == "timed_out"


def test_cancel_kills_the_process_group(client: DevboxClient, workspace: str, server) -> None:
    # A background loop in the command's group (a pid would not do: in the sandbox the command
    # sees its own pid namespace): once canceled, it stops writing.
    started = client.start_command(
        workspace, shell="(while true; do echo x >> beat; sleep 0.05; done) & echo up; wait"
    )
    assert wait_until(lambda: client.command_status(started.execution_id).stdout_tail != "")
    beat = server.root / "workspaces" / workspace / "beat"
    assert wait_until(lambda: beat.exists() and beat.stat().st_size > 0)
    status = client.cancel_command(started.execution_id)
    assert status.status == "cancelled"
    time.sleep(0.3)
    size = beat.stat().st_size
    time.sleep(0.5)
    assert beat.stat().st_size == size, "the background loop outlived the cancel"
    # cancelling a finished command leaves it as it ended
    assert client.cancel_command(started.execution_id).status == "cancelled"


def test_denied_commands_are_refused(make_server: ServerFactory) -> None:
    server = make_server(policy=CommandPolicy(deny=["sudo", "rm"]))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        for kwargs in (
            {"argv": ["sudo", "ls"]},
            {"argv": ["/usr/bin/rm", "-rf", "x"]},
            {"argv": ["env", "FOO=1", "rm", "x"]},
            {"shell": "rm -rf x"},
            {"shell": "ls && sudo reboot"},
        ):
            with pytest.raises(DevboxError) as info:
                c.start_command("ws", **kwargs)
            assert info.value.status == 403, kwargs
            assert "denied" in info.value.message
        assert c.start_command("ws", ["ls"]).status == "running"


def test_allow_list(make_server: ServerFactory) -> None:
    server = make_server(policy=CommandPolicy(allow=["echo"], deny=[]))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        assert c.start_command("ws", shell="echo hi").status == "running"
        with pytest.raises(DevboxError) as info:
            c.start_command("ws", shell="echo hi; cat /etc/passwd")
    assert info.value.status == 403
    assert "'cat'" in info.value.message


def test_environment_is_scrubbed(
    client: DevboxClient, workspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHARLIE_SECRET_X", "s3cret-one")
    monkeypatch.setenv("FOO_API_KEY", "s3cret-two")
    monkeypatch.setenv("HARMLESS_BUT_UNLISTED", "nope")
    started = client.start_command(workspace, ["env"], env={"MY_SETTING": "yes"})
    status = client.wait_command(started.execution_id)
    env = dict(line.split("=", 1) for line in status.stdout_tail.splitlines() if "=" in line)
    assert "s3cret" not in status.stdout_tail
    assert "CHARLIE_SECRET_X" not in env and "FOO_API_KEY" not in env
    assert "HARMLESS_BUT_UNLISTED" not in env  # minimal env, not a filtered copy
    assert env["MY_SETTING"] == "yes"
    assert env["HOME"] == client.get_workspace(workspace).path
    assert "PATH" in env


def test_cwd_must_stay_inside(client: DevboxClient, workspace: str) -> None:
    client.write_file(workspace, "sub/f.txt", "x")
    started = client.start_command(workspace, ["pwd"], cwd="sub")
    assert client.wait_command(started.execution_id).stdout_tail.strip().endswith("/ws/sub")
    with pytest.raises(DevboxError) as info:
        client.start_command(workspace, ["pwd"], cwd="../..")
    assert info.value.status == 400


def test_bad_requests(client: DevboxClient, workspace: str) -> None:
    with pytest.raises(DevboxError) as info:
        client.command_status("not-a-uuid")
    assert info.value.status == 404
    with pytest.raises(DevboxError) as info:
        client.command_status("00000000-0000-0000-0000-000000000000")
    assert info.value.status == 404
    with pytest.raises(DevboxError) as info:
        client.start_command("no-such-ws", ["ls"])
    assert info.value.status == 404
    with pytest.raises(DevboxError) as info:
        client.start_command(workspace, ["definitely-not-a-program-xyz"])
    assert info.value.status == 400
    assert "definitely-not-a-program-xyz" in info.value.message
    with pytest.raises(DevboxError) as info:
        client.start_command(workspace, ["ls"], timeout=-1)
    assert info.value.status == 400


def test_a_command_that_fills_its_workspace_past_the_cap_is_killed(
    make_server: ServerFactory,
) -> None:
    """The per-workspace disk cap binds what commands write, not only file writes."""
    server = make_server(limits=Limits(workspace_bytes=200_000))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        # Writes 100 KB a tenth of a second, for up to 30 s.
        started = c.start_command(
            "ws", shell="for i in $(seq 300); do head -c 100000 /dev/zero >> big; sleep 0.1; done"
        )
        status = c.wait_command(started.execution_id, timeout=20)
        assert status.status == "killed"
        assert "disk cap of 200000 bytes" in (status.reason or "")
        assert (server.root / "workspaces").exists()
