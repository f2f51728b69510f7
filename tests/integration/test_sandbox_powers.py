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

import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.sandbox import SandboxUnavailable, network_stack
from tests.support.cluster import SANDBOX_PROBLEM, Cluster
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


def _stack_problem() -> str | None:
    try:
        network_stack("auto")
    except SandboxUnavailable as exc:
        return str(exc)
    return None
