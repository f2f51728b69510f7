"""The devbox reads no more of what a workspace holds than it returns (the result cap; I15 on
the worker's side): a diff of hundreds of MiB is read up to the output limit and cut there,
with git's output drained so git finishes; read_file of a sparse 50 GB file is refused by its
size without reading it. The devbox runs as its own process with its address space limited
(RLIMIT_AS), so a devbox that held the whole diff would fail instead of taking the machine's
memory, and its peak RSS (VmHWM) is checked to stay far below what git wrote."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from charlie.devbox import DevboxClient, DevboxError, Limits
from tests.devbox.conftest import TOKEN, ServerProcess
from tests.integration.test_bounded_reads import GIB, MIB, peak_rss

#: what is bounded is the reader's, whatever the backend
pytestmark = pytest.mark.backend_free

ADDRESS_SPACE = GIB
PEAK_RSS = 300 * MIB
FILES, FILE_BYTES = 3, 100 * MIB


def git(ws: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=ws,
        check=True,
        capture_output=True,
    )


def fill(path: Path, char: bytes) -> None:
    """``FILE_BYTES`` of lines a KiB long (long lines: git's diff of them needs little)."""
    block = (char * 1023 + b"\n") * 1024
    with open(path, "wb") as f:
        for _ in range(FILE_BYTES // len(block)):
            f.write(block)


def test_a_diff_of_hundreds_of_mib_is_read_up_to_the_limit(
    spawn_server: Callable[..., ServerProcess], devbox_root: Path
) -> None:
    box = spawn_server(address_space=ADDRESS_SPACE)
    with DevboxClient(box.url, TOKEN) as client:
        client.ensure_workspace("ws", None)
        ws = devbox_root / "workspaces" / "ws"
        # what the agent's commands could have done: big files committed, then all rewritten
        for i in range(FILES):
            fill(ws / f"big{i}.txt", b"a")
        git(ws, "add", "-A")
        git(ws, "commit", "-q", "-m", "big files")
        for i in range(FILES):
            fill(ws / f"big{i}.txt", b"b")
        diff = client.diff("ws")
    limit = Limits().output_bytes
    assert diff.truncated
    assert diff.diff.endswith(f"\n[diff truncated at {limit} bytes]\n")
    assert "-" + "a" * 1023 + "\n" in diff.diff
    assert len(diff.diff.encode()) < limit + 100
    assert box.proc.poll() is None
    assert peak_rss(box.proc.pid) < PEAK_RSS, f"{peak_rss(box.proc.pid) / MIB:.0f} MiB"


def test_read_file_of_a_sparse_50_gb_file_is_refused_unread(
    spawn_server: Callable[..., ServerProcess], devbox_root: Path
) -> None:
    box = spawn_server(address_space=ADDRESS_SPACE)
    with DevboxClient(box.url, TOKEN) as client:
        client.ensure_workspace("ws", None)
        with open(devbox_root / "workspaces" / "ws" / "sparse.bin", "wb") as f:
            os.truncate(f.fileno(), 50 * GIB)
        with pytest.raises(DevboxError) as refused:
            client.read_file("ws", "sparse.bin")
    assert refused.value.status == 413
    assert f"is {50 * GIB} bytes, over the devbox read limit" in str(refused.value)
    assert peak_rss(box.proc.pid) < PEAK_RSS


def test_list_files_returns_at_most_its_limit_of_one_directory(
    client: DevboxClient, workspace: str, devbox_root: Path
) -> None:
    limit = Limits().list_entries
    crowded = devbox_root / "workspaces" / workspace / "crowded"
    crowded.mkdir()
    for i in range(limit + 1):
        (crowded / f"f{i:05}").touch()
    data = client._call("GET", f"/workspaces/{workspace}/list", params={"path": "crowded"})
    assert data["truncated"] is True
    assert len(data["entries"]) == limit
    names = [e["name"] for e in data["entries"]]
    assert names == sorted(names)
