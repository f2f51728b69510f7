"""A command allowed the network reaches the outside, never the control plane.

It gets its own network namespace behind a user-mode stack (slirp4netns or pasta): through real
workers and the real devbox over real bubblewrap, it cannot connect to a server on the host's
loopback (where PostgreSQL, Redis, the devbox and the console listen) nor on the host's own
non-loopback address, nor a neighbour on a network the host is directly attached to (where a
cluster's other services live: a compose network, the LAN), yet reaches a server "outside",
behind a gateway. There is no internet here, so the outside is a network namespace this test
makes (as root), with addresses it creates itself: a veth pair on 10.200.N.0/30 (the host's
attached network; the namespace's end is the neighbour) and 10.201.N.1 behind it, which the host
routes via the neighbour (the outside). The sandboxed command gets there only through the
user-mode stack. CHARLIE_SANDBOX_NET_DENY makes a network unreachable too.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.sandbox import (
    SandboxPolicy,
    SandboxUnavailable,
    host_addresses,
    network_stack,
    stack_problem,
    wrap,
)
from tests.devbox.cluster_support import DevboxProcess
from tests.support.cluster import REPO, SANDBOX_PROBLEM, Cluster
from tests.support.needs import need


def _stack_problem() -> str | None:
    if SANDBOX_PROBLEM is not None:
        return f"no sandbox here: {SANDBOX_PROBLEM}"
    try:
        network_stack("auto")
    except SandboxUnavailable as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.backend_free  # the policy is the sandbox's, whatever the backend


@pytest.fixture(autouse=True)
def _needs_a_stack() -> None:
    need(_stack_problem(), "no user-mode network stack here")


#: connects to each host:port given, prints what it got
PROBE = textwrap.dedent(
    """
    import socket, sys
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), 3) as s:
                s.settimeout(3)
                print(target, "open", s.recv(100).decode().strip() or "-")
        except OSError as exc:
            print(target, "closed", exc)
    """
)


@dataclass
class Outside:
    """A server in a network namespace of its own, reachable from the host at ``address``
    (behind a gateway: the outside) and ``neighbour`` (on a network the host is attached to)."""

    address: str
    neighbour: str
    port: int
    greeting: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def outside() -> Iterator[Outside]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("making a network namespace and a veth pair needs root and iproute2")
    tag = secrets.token_hex(3)
    netns, host_if, ns_if = f"chx{tag}", f"chx{tag}a", f"chx{tag}b"
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    third = next(n for n in random.sample(range(1, 255), 254) if f"10.200.{n}." not in routes)
    host_addr, ns_addr = f"10.200.{third}.1", f"10.200.{third}.2"
    far_addr = f"10.201.{third}.1"
    greeting = f"outside-{tag}"
    server: subprocess.Popen[bytes] | None = None
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", netns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", netns, "addr", "add", f"{ns_addr}/30", "dev", ns_if)
        _ip("-n", netns, "link", "set", ns_if, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "addr", "add", f"{far_addr}/32", "dev", "lo")
        _ip("route", "add", f"{far_addr}/32", "via", ns_addr)
        # answers every connection with the greeting, for a minute at most
        serve = textwrap.dedent(
            f"""
            import socket, sys, time
            s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(16); s.settimeout(1)
            print(s.getsockname()[1], flush=True)
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                conn.sendall(b"{greeting}\\n"); conn.close()
            """
        )
        server = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", serve], stdout=subprocess.PIPE
        )
        assert server.stdout is not None
        port = int(server.stdout.readline())
        # the host itself reaches it (so a failure below is the sandbox's, not the setup's)
        for address in (far_addr, ns_addr):
            with socket.create_connection((address, port), 5) as s:
                assert s.recv(100).decode().strip() == greeting
        yield Outside(far_addr, ns_addr, port, greeting)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host_if)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", netns)


@contextlib.contextmanager
def _servers() -> Iterator[dict[str, int]]:
    """Servers standing for the control plane: one on loopback, one on every address."""
    with socket.socket() as lo, socket.socket() as anywhere:
        lo.bind(("127.0.0.1", 0))
        anywhere.bind(("0.0.0.0", 0))
        for s in (lo, anywhere):
            s.listen(16)
        yield {"loopback": lo.getsockname()[1], "anywhere": anywhere.getsockname()[1]}


def _targets(ports: dict[str, int], out: Outside) -> list[str]:
    """The control plane (loopback, the host's own addresses, a neighbour), then the outside."""
    targets = [f"127.0.0.1:{ports['loopback']}", f"127.0.0.1:{ports['anywhere']}"]
    own = [n.split("/")[0] for n in host_addresses() if ":" not in n]
    targets += [f"{a}:{ports['anywhere']}" for a in own if not a.startswith("10.200.")]
    targets.append(f"{out.neighbour}:{out.port}")
    return [*targets, f"{out.address}:{out.port}"]


def _check(stdout: str, targets: list[str], out: Outside) -> None:
    lines = dict(line.split(" ", 1) for line in stdout.strip().splitlines() if " " in line)
    *control_plane, outside_target = targets
    for target in control_plane:
        assert lines[target].startswith("closed"), (target, stdout)
    assert lines[outside_target] == f"open {out.greeting}", stdout
    assert "nameserver" in stdout  # a resolver is configured inside


def test_a_local_command_with_the_network_reaches_the_outside_not_the_host(
    cluster: Cluster, script: Any, workspace: Path, outside: Outside
) -> None:
    (workspace / "probe.py").write_text(PROBE)
    with _servers() as ports:
        targets = _targets(ports, outside)
        command = f"python3 probe.py {' '.join(targets)}; cat /etc/resolv.conf"
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
            "probe",
            model=model,
            metadata={"workspace": str(workspace), "sandbox": {"network": True}},
        )
        info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok", result.payload
    _check(str(result.payload["result"]["stdout"]), targets, outside)


def test_a_devbox_command_with_the_network_reaches_the_outside_not_the_host(
    tmp_path: Path, outside: Outside
) -> None:
    from charlie.devbox import DevboxClient

    box = DevboxProcess(tmp_path / "devbox", tmp_path / "devbox.log", args=("--allow-network",))
    try:
        with DevboxClient(box.url, box.token) as client, _servers() as ports:
            client.ensure_workspace("a", None)
            client.write_file("a", "probe.py", PROBE)
            targets = _targets(ports, outside)
            started = client.start_command(
                "a",
                shell=f"python3 probe.py {' '.join(targets)}; cat /etc/resolv.conf",
                network=True,
            )
            status = client.wait_command(started.execution_id, timeout=30)
            assert status.exit_code == 0, status
            _check(status.stdout_tail, targets, outside)
    finally:
        box.kill()


@pytest.mark.parametrize("stack", ["pasta", "slirp4netns"])
def test_each_stack_reaches_the_outside_not_the_host_nor_a_denied_network(
    tmp_path: Path, outside: Outside, stack: str
) -> None:
    """Both stacks (CHARLIE_SANDBOX_NETWORK), through wrap and the real launcher; and
    CHARLIE_SANDBOX_NET_DENY (SandboxPolicy.unreachable): the cluster's networks on other
    machines are routed to nowhere inside the command's namespace."""
    problem = stack_problem(stack)
    if problem is not None:
        pytest.skip(problem)
    (tmp_path / "probe.py").write_text(PROBE)
    env = {"PATH": "/usr/bin:/bin"}
    with _servers() as ports:
        targets = _targets(ports, outside)
        for deny in ((), (f"{outside.address}/32",)):
            policy = SandboxPolicy(
                workspace=tmp_path, network=True, network_stack=stack, unreachable=deny
            )
            command = f"python3 probe.py {' '.join(targets)}; cat /etc/resolv.conf"
            argv = wrap(["/bin/sh", "-c", command], policy, env=env)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
            assert done.returncode == 0, done.stderr
            if deny:
                line = next(x for x in done.stdout.splitlines() if x.startswith(targets[-1]))
                assert " closed " in line, done.stdout
            else:
                _check(done.stdout, targets, outside)


def test_without_a_network_stack_network_access_is_refused() -> None:
    """Neither pasta nor slirp4netns: a clear error naming what to install, never the host's
    network instead."""
    probe = textwrap.dedent(
        """
        import charlie.sandbox as s
        s.BWRAP_ENV["PATH"] = "/nonexistent"  # where the stacks are looked for
        try:
            s.network_stack("auto")
        except s.SandboxUnavailable as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert "network access is refused" in done.stdout, done.stderr
    assert "apt-get install passt slirp4netns" in done.stdout


def _group(pgid: int) -> list[str]:
    """The processes still in the process group ``pgid``: their command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_cancelling_a_command_with_the_network_ends_its_stack_too(tmp_path: Path) -> None:
    """The launcher and the stack stay in the command's process group, so the group's SIGKILL
    (cancel, timeout, a lost lease) leaves no pasta or slirp4netns running for it."""
    from charlie.devbox import DevboxClient

    box = DevboxProcess(tmp_path / "devbox", tmp_path / "devbox.log", args=("--allow-network",))
    try:
        with DevboxClient(box.url, box.token) as client:
            client.ensure_workspace("a", None)
            started = client.start_command("a", shell="echo up; sleep 60", network=True)
            pid = client.command_status(started.execution_id).pid
            assert pid is not None
            deadline = time.monotonic() + 20
            while "up" not in client.command_status(started.execution_id).stdout_tail:
                assert time.monotonic() < deadline, "the command did not start"
                time.sleep(0.1)
            running = _group(pid)
            assert any(("pasta" in c or "slirp4netns" in c) for c in running), running
            assert client.cancel_command(started.execution_id).status == "cancelled"
            deadline = time.monotonic() + 10
            while _group(pid):
                assert time.monotonic() < deadline, _group(pid)
                time.sleep(0.1)
    finally:
        box.kill()


#: run as an unprivileged user (the Docker image's workers are not root): bubblewrap then
#: makes user namespaces of its own, and the stacks must join the one owning the network's
AS_USER = textwrap.dedent(
    """
    import importlib.util, json, socket, subprocess, sys
    spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
    sb = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sb)
    ws, stack, outside = sys.argv[2], sys.argv[3], sys.argv[4]
    lo = socket.socket(); lo.bind(("127.0.0.1", 0)); lo.listen(4)
    env = {"PATH": "/usr/bin:/bin"}
    policy = sb.SandboxPolicy(workspace=ws, network=True, network_stack=stack)
    targets = [f"127.0.0.1:{lo.getsockname()[1]}", outside]
    argv = sb.wrap(["python3", "probe.py", *targets], policy, env=env)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    print(json.dumps({"uid": __import__("os").getuid(), "code": done.returncode,
                      "out": done.stdout, "err": done.stderr, "targets": targets}))
    """
)


@pytest.mark.parametrize("stack", ["pasta", "slirp4netns"])
def test_an_unprivileged_user_gets_the_same_network(outside: Outside, stack: str) -> None:
    import json
    import tempfile

    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if setpriv is None or not os.path.exists(python) or shutil.which(stack) is None:
        pytest.skip("needs setpriv (util-linux), Debian's python3 and the stack")
    ws = Path(tempfile.mkdtemp(prefix="charlie-sandbox-user-"))
    try:
        ws.chmod(0o777)
        (ws / "probe.py").write_text(PROBE)
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        script = [python, "-I", "-c", AS_USER, str(REPO / "charlie" / "sandbox.py")]
        done = subprocess.run(
            [*as_nobody, *script, str(ws), stack, f"{outside.address}:{outside.port}"],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(ws)},
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["uid"] == 65534
        assert result["code"] == 0, result
        loopback, out = result["targets"]
        lines = dict(x.split(" ", 1) for x in result["out"].splitlines())
        assert lines[loopback].startswith("closed"), result
        assert lines[out] == f"open {outside.greeting}", result
    finally:
        shutil.rmtree(ws, ignore_errors=True)
