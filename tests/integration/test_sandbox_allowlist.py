"""The sandbox shows an allow-list, not the machine minus known secrets, and hands a command its
environment inside the sandbox.

A command the model asked for is attacker-controlled: through real workers and the real
devbox, over real bubblewrap, it cannot read what the machine keeps under /srv, /opt, /var/lib,
another user's home or an MCP configuration under /etc, yet still runs sh, python, git and ls,
reads and writes its workspace, and reads the directory the operator added
(CHARLIE_SANDBOX_READ). bubblewrap itself runs outside the sandbox with a fixed minimal
environment: a request's variables reach only the command, and loader variables (LD_PRELOAD...)
are refused outright.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.devbox.cluster_support import DevboxProcess
from tests.support.cluster import SANDBOX_PROBLEM, Cluster
from tests.support.needs import need

pytestmark = pytest.mark.backend_free  # the sandbox's view, whatever the backend


@pytest.fixture(autouse=True)
def _needs_sandbox() -> None:
    need(SANDBOX_PROBLEM, "no sandbox here")


#: what the probe prints for what must work
WORKS = ("sh: ok", "python: ok", "git version", "ls: ok", "workspace: mine", "operator: shared")


class Secrets:
    """Files the machine keeps outside any workspace, each holding a unique marker."""

    def __init__(self, operator_dir: Path) -> None:
        tag = uuid.uuid4().hex[:10]
        self.marker = f"secret-{tag}"
        self.dirs = [
            Path(f"/srv/charlie-test-{tag}"),
            Path(f"/opt/charlie-test-{tag}"),
            Path(f"/var/lib/charlie-test-{tag}"),
            Path(f"/home/charlie-test-other-{tag}"),  # another user's home
            Path(f"/etc/charlie-test-{tag}"),  # where an operator keeps the MCP configuration
        ]
        self.files = [d / "secret.txt" for d in self.dirs[:-1]]
        self.files.append(self.dirs[-1] / "mcp.json")
        self.operator_dir = operator_dir
        try:
            for f in self.files:
                f.parent.mkdir(parents=True)
                f.write_text(self.marker if f.suffix == ".txt" else self._mcp())
            operator_dir.mkdir(parents=True, exist_ok=True)
            (operator_dir / "shared.txt").write_text("shared")
        except PermissionError:
            self.remove()
            pytest.skip("making files under /srv, /opt, /var/lib, /home and /etc needs root")

    def _mcp(self) -> str:
        server = {"headers": {"Authorization": f"Bearer {self.marker}"}}
        return json.dumps({"mcpServers": {"x": server}})

    def remove(self) -> None:
        for d in [*self.dirs, self.operator_dir]:
            shutil.rmtree(d, ignore_errors=True)

    def probe(self) -> str:
        """A shell command that tries every secret and everything a command needs."""
        reads = "; ".join(f"cat {f} 2>&1" for f in self.files)
        return (
            f"{reads}; echo 'sh: ok'; python3 -c 'print(\"python: ok\")'; git --version; "
            "ls >/dev/null && echo 'ls: ok'; echo mine > mine.txt; echo \"workspace: $(cat "
            f'mine.txt)"; echo "operator: $(cat {self.operator_dir}/shared.txt)"'
        )

    def check(self, out: str) -> None:
        assert self.marker not in out, out
        for expected in WORKS:
            assert expected in out, (expected, out)


@pytest.fixture
def secrets(cluster_session: Cluster) -> Iterator[Secrets]:
    found = Secrets(Path(cluster_session.settings_env["CHARLIE_SANDBOX_READ"]))
    yield found
    found.remove()


def _run_task(script: Any, workspace: Path, command: str) -> str:
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
    task_id = charlie.submit("probe", model=model, metadata={"workspace": str(workspace)})
    info = charlie.wait(task_id, timeout=60)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    result = next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")
    assert result.outcome == "ok", result.payload
    return str(result.payload["result"]["stdout"])


def test_a_local_command_reads_only_the_allow_list(
    cluster: Cluster, script: Any, workspace: Path, secrets: Secrets
) -> None:
    secrets.check(_run_task(script, workspace, secrets.probe()))
    assert (workspace / "mine.txt").read_text() == "mine\n"


def test_a_devbox_command_reads_only_the_allow_list(tmp_path: Path, secrets: Secrets) -> None:
    from charlie.devbox import DevboxClient

    box = DevboxProcess(
        tmp_path / "devbox",
        tmp_path / "devbox.log",
        env={"CHARLIE_SANDBOX_READ": str(secrets.operator_dir)},
    )
    try:
        with DevboxClient(box.url, box.token) as client:
            client.ensure_workspace("a", None)
            started = client.start_command("a", shell=secrets.probe())
            status = client.wait_command(started.execution_id, timeout=30)
            assert status.exit_code == 0, status
            secrets.check(status.stdout_tail)
    finally:
        box.kill()


def test_bubblewrap_runs_with_a_fixed_environment_the_command_with_its_own(
    cluster: Cluster, script: Any, workspace: Path
) -> None:
    """Inside the pid namespace, pid 1 is bubblewrap's own process: its environment is the
    fixed minimal one, not the command's (HOME=the workspace, set inside the sandbox)."""
    out = _run_task(script, workspace, "echo \"home=$HOME\"; tr '\\0' '\\n' < /proc/1/environ")
    assert f"home={workspace}" in out, out
    bwrap_env = out.split("\n", 1)[1]
    assert "HOME=" not in bwrap_env and "LANG=C" in bwrap_env, out


def test_a_devbox_request_env_reaches_the_command_never_bubblewrap(tmp_path: Path) -> None:
    from charlie.devbox import DevboxClient, DevboxError

    box = DevboxProcess(tmp_path / "devbox", tmp_path / "devbox.log")
    try:
        with DevboxClient(box.url, box.token) as client:
            client.ensure_workspace("a", None)
            for name in ("LD_PRELOAD", "LD_LIBRARY_PATH", "GCONV_PATH", "GLIBC_TUNABLES"):
                with pytest.raises(DevboxError) as refused:
                    client.start_command("a", ["true"], env={name: "/tmp/evil.so"})
                assert refused.value.status == 400, name
                assert name in refused.value.message
            started = client.start_command(
                "a",
                shell="echo \"probe=$PROBE_VAR\"; tr '\\0' '\\n' < /proc/1/environ; sleep 5",
                env={"PROBE_VAR": "from-the-request"},
            )
            pid = client.command_status(started.execution_id).pid
            assert pid is not None
            # the unsandboxed process the devbox started (bubblewrap), seen from outside
            outside = _environ(pid)
            status = client.wait_command(started.execution_id, timeout=30)
            assert status.exit_code == 0, status
            assert "probe=from-the-request" in status.stdout_tail
            inside_pid1 = status.stdout_tail.split("\n", 1)[1]
            for env in (outside, inside_pid1):
                assert "PROBE_VAR" not in env, env
                assert "HOME=" not in env, env
    finally:
        box.kill()


def _environ(pid: int) -> str:
    deadline = time.monotonic() + 5
    while True:
        try:
            return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_hidden_paths_stay_hidden_inside_what_is_shown(tmp_path: Path) -> None:
    """CHARLIE_SANDBOX_HIDE (SandboxPolicy.hidden) still empties what lies inside something the
    sandbox shows, here an operator's directory (CHARLIE_SANDBOX_READ)."""
    import subprocess

    from charlie.sandbox import BWRAP_ENV, SandboxPolicy, wrap

    shared = tmp_path / "shared"
    (shared / "private").mkdir(parents=True)
    (shared / "public.txt").write_text("public")
    (shared / "private" / "key.txt").write_text("private key")
    (shared / "token.txt").write_text("a token")
    ws = tmp_path / "ws"
    ws.mkdir()
    policy = SandboxPolicy(
        workspace=ws,
        readable=(shared,),
        hidden=(shared / "private", shared / "token.txt"),
    )
    probe = f"cat {shared}/public.txt {shared}/private/key.txt {shared}/token.txt 2>&1"
    done = subprocess.run(
        wrap(["/bin/sh", "-c", probe], policy, env={"PATH": "/usr/bin:/bin"}),
        env=BWRAP_ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "public" in done.stdout, done
    assert "private key" not in done.stdout and "a token" not in done.stdout, done.stdout


def test_a_version_managers_shims_run_in_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PATH with a version manager's shims (pyenv, rbenv, asdf: ROOT/shims/python3 runs
    ROOT/libexec/...) runs its commands: the shim alone would find no manager (a demo's
    `python3` failed with exit 127 under pyenv's shims)."""
    import subprocess

    from charlie.sandbox import BWRAP_ENV, SandboxPolicy, wrap

    root = tmp_path / "manager"
    (root / "shims").mkdir(parents=True)
    (root / "libexec").mkdir()
    shim = root / "shims" / "tool"
    shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/../libexec/real" "$@"\n')
    real = root / "libexec" / "real"
    real.write_text("#!/bin/sh\necho managed $1\n")
    for f in (shim, real):
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{root / 'shims'}:/usr/bin:/bin")
    ws = tmp_path / "ws"
    ws.mkdir()
    done = subprocess.run(
        wrap(["tool", "ok"], SandboxPolicy(workspace=ws), env={"PATH": f"{root / 'shims'}:/bin"}),
        env=BWRAP_ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout.strip() == "managed ok", done
