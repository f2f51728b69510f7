"""A sandboxed command has none of root's powers, whoever runs Charlie.

Run as root (systemd units, many containers, CI), bubblewrap would keep root's capabilities
inside the sandbox: a command could mount a filesystem (the host's disk, Charlie's home on it),
make a block device, and in network mode delete the unreachable routes that keep it off the
host's addresses and the cloud metadata address. Through a real worker's ``run_command``, the
real devbox and ``wrap`` with each network stack: no capability is left (CapEff 0), ``mount``
and ``mknod`` are refused, the routes stay, and the workspace stays the command's to write (a
file the worker made, a new one and a new directory), what it made the worker's to read and
delete. An unprivileged user's sandbox keeps working the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.sandbox import SandboxPolicy, SandboxUnavailable, network_stack, stack_problem, wrap
from tests.devbox.cluster_support import DevboxProcess
from tests.support.cluster import REPO, SANDBOX_PROBLEM, Cluster
from tests.support.needs import need


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    need(SANDBOX_PROBLEM, "no sandbox here")
    need(None if shutil.which("ip") else "iproute2 is not installed", "no ip command")


#: what a command tries with root's powers; every line says what it got
PROBE = textwrap.dedent(
    """
    grep CapEff /proc/self/status
    if mount -t tmpfs none /tmp 2>/dev/null; then echo "mount: done"; else echo "mount: refused"; fi
    if mknod blk b 8 0 2>/dev/null; then echo "mknod: done"; else echo "mknod: refused"; fi
    ip route show > routes.before
    while read -r route; do
        ip route del $route 2>/dev/null && echo "deleted: $route"
    done < routes.before
    ip route show > routes.after
    if cmp -s routes.before routes.after; then echo "routes: kept"; else echo "routes: changed"; fi
    echo "$(wc -l < routes.before) routes"
    echo appended >> given.txt && mkdir -p made/deeper && echo made > made/deeper/made.txt
    chmod 700 made && echo "written: yes"
    """
)


def _prepare(workspace: Path) -> None:
    (workspace / "powers.sh").write_text(PROBE)
    (workspace / "given.txt").write_text("the worker's\n")


def _check(out: str, workspace: Path, network: bool) -> None:
    lines = out.splitlines()
    assert "CapEff:\t0000000000000000" in lines, out
    assert "mount: refused" in lines, out
    assert "mknod: refused" in lines, out
    assert not [line for line in lines if line.startswith("deleted:")], out
    assert "routes: kept" in lines, out
    if network:
        # the user-mode stack's default route and the unreachable ones were there to delete
        assert int(next(x for x in lines if x.endswith(" routes")).split()[0]) >= 2, out
        assert "unreachable 169.254.169.254" in (workspace / "routes.after").read_text()
    assert "written: yes" in lines, out
    # the worker reads what the command wrote and made, and can delete it
    assert (workspace / "given.txt").read_text() == "the worker's\nappended\n"
    made = workspace / "made" / "deeper" / "made.txt"
    assert made.read_text() == "made\n"
    assert made.stat().st_uid == os.geteuid()
    shutil.rmtree(workspace / "made")


@pytest.mark.parametrize("network", [False, True], ids=["offline", "network"])
def test_a_workers_command_has_none_of_roots_powers(
    cluster: Cluster, script: Any, workspace: Path, network: bool
) -> None:
    if network:
        need(_stack_problem(), "no user-mode network stack here")
    _prepare(workspace)
    model, _ = script(
        [
            {
                "say": "try",
                "tool_calls": [
                    {"id": "p", "name": "run_command", "arguments": {"command": "sh powers.sh"}}
                ],
            },
            {"say": "done"},
        ]
    )
    metadata: dict[str, Any] = {"workspace": str(workspace)}
    if network:
        metadata["sandbox"] = {"network": True}
    task_id = charlie.submit("powers", model=model, metadata=metadata)
    info = charlie.wait(task_id, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok", result.payload
    _check(str(result.payload["result"]["stdout"]), workspace, network)


def test_a_devbox_command_has_none_of_roots_powers(tmp_path: Path) -> None:
    from charlie.devbox import DevboxClient

    need(_stack_problem(), "no user-mode network stack here")
    box = DevboxProcess(tmp_path / "devbox", tmp_path / "devbox.log", args=("--allow-network",))
    try:
        with DevboxClient(box.url, box.token) as client:
            path = Path(client.ensure_workspace("a", None).path)
            _prepare(path)
            started = client.start_command("a", shell="sh powers.sh", network=True)
            status = client.wait_command(started.execution_id, timeout=60)
            assert status.exit_code == 0, status
            _check(status.stdout_tail, path, network=True)
            # the devbox's own git (in the same sandbox) still works on what the command left
            client.write_file("a", "after.txt", "after")
            assert "after.txt" in client.diff("a").untracked
            assert client.commit("a", "after", "powers-1").created
    finally:
        box.kill()


def _stack_problem() -> str | None:
    try:
        network_stack("auto")
    except SandboxUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("stack", ["pasta", "slirp4netns"])
def test_with_each_stack_the_routes_stay(tmp_path: Path, stack: str) -> None:
    problem = stack_problem(stack)
    if problem is not None:
        pytest.skip(problem)
    _prepare(tmp_path)
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    policy = SandboxPolicy(workspace=tmp_path, network=True, network_stack=stack)
    argv = wrap(["/bin/sh", "powers.sh"], policy, env=env)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    _check(done.stdout, tmp_path, network=True)


#: run as an unprivileged user: bubblewrap's own user namespace, the same refusals
AS_USER = textwrap.dedent(
    """
    import importlib.util, json, subprocess, sys
    spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
    sb = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    ws, network = sys.argv[2], sys.argv[3] == "network"
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    policy = sb.SandboxPolicy(workspace=ws, network=network)
    argv = sb.wrap(["/bin/sh", "powers.sh"], policy, env=env)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    print(json.dumps({"uid": __import__("os").getuid(), "code": done.returncode,
                      "out": done.stdout, "err": done.stderr}))
    """
)


@pytest.mark.parametrize("network", [False, True], ids=["offline", "network"])
def test_an_unprivileged_users_sandbox_works_the_same(network: bool) -> None:
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or setpriv is None or not os.path.exists(python):
        pytest.skip("needs root (to become nobody), setpriv (util-linux) and Debian's python3")
    if network:
        need(_stack_problem(), "no user-mode network stack here")
    ws = Path(tempfile.mkdtemp(prefix="charlie-sandbox-powers-"))
    try:
        _prepare(ws)
        for path in (ws, ws / "given.txt"):
            os.chown(path, 65534, 65534)
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        script = [python, "-I", "-c", AS_USER, str(REPO / "charlie" / "sandbox.py")]
        done = subprocess.run(
            [*as_nobody, *script, str(ws), "network" if network else "offline"],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(ws)},
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["uid"] == 65534
        assert result["code"] == 0, result
        lines = result["out"].splitlines()
        assert "CapEff:\t0000000000000000" in lines, result
        assert "mount: refused" in lines and "mknod: refused" in lines, result
        assert "routes: kept" in lines and "written: yes" in lines, result
        made = ws / "made" / "deeper" / "made.txt"
        assert made.read_text() == "made\n" and made.stat().st_uid == 65534
    finally:
        shutil.rmtree(ws, ignore_errors=True)
