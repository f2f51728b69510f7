"""A sandboxed command has none of root's powers, without a worker: the devbox's commands,
``wrap`` with each network stack, and an unprivileged user's sandbox (see
tests/integration/test_sandbox_powers.py for what is checked, and a worker's command)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from charlie.sandbox import SandboxPolicy, stack_problem, wrap
from tests.devbox.cluster_support import DevboxProcess
from tests.integration.test_sandbox_powers import _check, _prepare, _stack_problem
from tests.support.cluster import REPO, SANDBOX_PROBLEM
from tests.support.needs import need

pytestmark = pytest.mark.backend_free  # the sandbox's, whatever the backend


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    need(SANDBOX_PROBLEM, "no sandbox here")
    need(None if shutil.which("ip") else "iproute2 is not installed", "no ip command")


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
