"""What a tool reads of what the agent controls is bounded while it is read (the result cap, and
I15: the run goes on): ``read_file`` of a sparse 50 GB file reads no more than the cap, and the
local ``run_command`` of a command that writes gigabytes keeps only its tail.

Each runs on a worker whose address space is limited (RLIMIT_AS, ``Cluster.limited``), so a read
that held the whole file or the whole output would fail with MemoryError (or take the worker
down) instead of the machine's memory; and the worker's own peak resident memory (VmHWM) is
checked to have stayed far below what was read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.support.cluster import Cluster

#: what is bounded is the reader's, whatever the backend
pytestmark = pytest.mark.backend_free

MIB = 1024 * 1024
GIB = 1024 * MIB
#: the workers' address space: room for Python, Celery and their threads, not for a
#: gigabyte more.
ADDRESS_SPACE = 1536 * MIB
#: the most any of the worker's processes may have held at once (its peak RSS).
PEAK_RSS = 400 * MIB


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.fixture
def limited(cluster: Cluster) -> Iterator[Cluster]:
    with cluster.limited(ADDRESS_SPACE) as small:
        yield small


def run_one_call(script: Any, workspace: Path, name: str, arguments: dict[str, Any]) -> Any:
    """Run a task whose model makes one call, then answers: the call's result entry."""
    model, _ = script(
        [
            {"say": "calling", "tool_calls": [{"id": "c", "name": name, "arguments": arguments}]},
            {"say": "done"},
        ]
    )
    task_id = charlie.submit("read it", model=model, metadata={"workspace": str(workspace)})
    info = charlie.wait(task_id, timeout=240)
    # I15: whatever the call met, the run went on to its answer
    assert info.status is TaskStatus.SUCCEEDED, info.error
    return next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")


def assert_worker_bounded(cluster: Cluster, before: dict[int, list[int]]) -> None:
    """The limited worker's processes are the ones it started with (none died of the read and
    was replaced), and none of them ever held more than PEAK_RSS."""
    after = cluster.worker_processes()
    assert sorted(after) == sorted(before), "a worker died during the read"
    for worker, pids in after.items():
        assert sorted(pids) == sorted(before[worker]), "a pool process died during the read"
        peaks = {pid: peak_rss(pid) for pid in pids}
        assert max(peaks.values()) < PEAK_RSS, {p: f"{v / MIB:.0f} MiB" for p, v in peaks.items()}


def settled(cluster: Cluster) -> dict[int, list[int]]:
    """The limited worker's processes, once its pool is up."""
    from tests.conftest import wait_for

    def pool_up() -> dict[int, list[int]] | None:
        found = cluster.worker_processes()
        return found if found and all(len(p) >= 3 for p in found.values()) else None

    found: dict[int, list[int]] = wait_for(pool_up, timeout=60)
    return found


def test_read_file_of_a_sparse_50_gb_file_reads_only_the_cap(
    limited: Cluster, script: Any, workspace: Path
) -> None:
    from charlie.tools.builtins import MAX_READ_BYTES

    big = workspace / "sparse.bin"
    with open(big, "wb") as f:
        f.write(b"a" * (MAX_READ_BYTES + 10))
        os.truncate(f.fileno(), 50 * GIB)  # the rest a hole: no disk, 50 GB to a reader
    before = settled(limited)
    entry = run_one_call(script, workspace, "read_file", {"path": "sparse.bin"})
    assert entry.outcome == "ok", entry.payload
    text = entry.payload["result"]
    assert isinstance(text, str)
    assert text.endswith(
        f"[truncated: file is {50 * GIB} bytes, showing the first {MAX_READ_BYTES}]"
    )
    assert text.startswith("a" * MAX_READ_BYTES + "\n[truncated")
    assert_worker_bounded(limited, before)


def test_run_command_writing_gigabytes_keeps_its_tail(
    limited: Cluster, script: Any, workspace: Path
) -> None:
    from charlie.tools.builtins import OUTPUT_TAIL_BYTES

    before = settled(limited)
    # 4 GiB of "y" lines, then a last line; and a little on stderr
    command = "yes | head -c 4G; echo the-end; echo on-stderr >&2"
    entry = run_one_call(script, workspace, "run_command", {"command": command})
    assert entry.outcome == "ok", entry.payload
    result = entry.payload["result"]
    assert result["exit_code"] == 0
    assert result["truncated"] is True
    assert result["stdout"].endswith("the-end\n")
    written = 4 * GIB + len("the-end\n")
    assert result["stdout"].startswith(f"[{written - OUTPUT_TAIL_BYTES} bytes cut]\ny\ny\n")
    assert result["stderr"] == "on-stderr\n"
    assert f"wrote {written} bytes to stdout and 10 to stderr" in result["note"]
    assert_worker_bounded(limited, before)


def test_list_files_reads_at_most_its_cap_of_one_directory(
    cluster: Cluster, script: Any, workspace: Path
) -> None:
    from charlie.tools.builtins import MAX_DIR_ENTRIES

    # a directory a command filled: more entries than are read of one (empty directories here,
    # so that no cap on files listed says it first)
    crowded = workspace / "crowded"
    crowded.mkdir()
    for i in range(MAX_DIR_ENTRIES + 1):
        (crowded / f"d{i:05}").mkdir()
    (workspace / "a.txt").write_text("a")
    entry = run_one_call(script, workspace, "list_files", {})
    assert entry.outcome == "ok", entry.payload
    assert entry.payload["result"] == [
        "a.txt",
        f"[truncated: a directory has more than {MAX_DIR_ENTRIES} entries]",
    ]
