"""What an MCP server sends is read with a bound while it is read (the result cap; I15: the run
goes on): a stdio server's stderr line of gigabytes is cut at 8 KiB as it goes by (with the
configuration's secrets blanked before the cut, not cut in two), and its answer of gigabytes is
never held: the call gets an error that says the answer was over the limit and dropped, and the
run goes on. Each runs on a worker whose address space is limited (RLIMIT_AS), whose processes
must all survive with a peak RSS far below what the server wrote (tests/integration/
test_bounded_reads.py has the local tools' side)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

import charlie
from charlie.domain import TaskStatus
from tests.integration.test_bounded_reads import (
    ADDRESS_SPACE,
    GIB,
    assert_worker_bounded,
    settled,
)
from tests.mcp.test_cluster import wait_until_workers_listed
from tests.support.cluster import MCP_STDIO_TOKEN, Cluster, McpServers

#: what is bounded is the reader's, whatever the backend
pytestmark = pytest.mark.backend_free

FLOOD = 3 * GIB


@pytest.fixture
def limited(cluster: Cluster, mcp_servers: McpServers) -> Iterator[Cluster]:
    with cluster.limited(ADDRESS_SPACE) as small:
        wait_until_workers_listed(small, "files")
        wait_until_workers_listed(small, "web")
        yield small


def flood(
    script: Any, arguments: dict[str, Any], server: str = "files", tool: str = "flood"
) -> tuple[str, Any]:
    """Run a task whose model calls a server's flood tool once, then answers: the task and
    the call's result entry."""
    name = f"mcp__{server}__{tool}"
    model, _ = script(
        [
            {
                "say": "flooding",
                "tool_calls": [{"id": "f", "name": name, "arguments": arguments}],
            },
            {"say": "done"},
        ]
    )
    task_id = charlie.submit("flood", model=model, tools=[name])
    info = charlie.wait(task_id, timeout=300)
    # I15: whatever the server sent, the run went on to its answer
    assert info.status is TaskStatus.SUCCEEDED, info.error
    return task_id, next(i for i in charlie.transcript(task_id) if i.kind == "tool_result")


def worker_logs(cluster: Cluster) -> str:
    return "\n".join(p.read_text(errors="replace") for p in cluster.home.glob("worker-*.log"))


def test_a_stderr_line_of_gigabytes_is_cut_as_it_is_read(limited: Cluster, script: Any) -> None:
    before = settled(limited)
    _, entry = flood(script, {"stderr_bytes": FLOOD})
    assert entry.outcome == "ok", entry.payload
    assert entry.payload["result"] == "flooded"
    assert_worker_bounded(limited, before)
    logs = worker_logs(limited)
    assert f"... [line cut: {FLOOD} bytes]" in logs
    # the token sat astride the cut: blanked whole, no first half of it kept
    assert MCP_STDIO_TOKEN[:12] not in logs
    assert "e" * 100 + "***" in logs


@pytest.mark.parametrize("id_last", [False, True], ids=["id-first", "id-last"])
def test_an_answer_of_gigabytes_is_dropped_unread_and_the_call_says_so(
    limited: Cluster, script: Any, id_last: bool
) -> None:
    before = settled(limited)
    _, entry = flood(script, {"result_bytes": FLOOD, "id_last": id_last})
    assert entry.outcome == "error", entry.payload
    result = entry.payload["result"]
    assert result["truncated"] is True
    assert "ran the call, but its answer was" in result["error"]
    assert "over the limit of 4194304 bytes on one MCP message" in result["error"]
    assert_worker_bounded(limited, before)


@pytest.mark.parametrize("declare_length", [False, True], ids=["chunked", "content-length"])
def test_a_json_answer_of_gigabytes_over_http_is_not_read_past_the_limit(
    limited: Cluster, script: Any, declare_length: bool
) -> None:
    before = settled(limited)
    arguments = {"result_bytes": FLOOD, "declare_length": declare_length}
    _, entry = flood(script, arguments, server="web")
    assert entry.outcome == "error", entry.payload
    result = entry.payload["result"]
    assert result["truncated"] is True
    assert "ran the call, but its answer was" in result["error"]
    if declare_length:
        # (the size its Content-Length declared: the body around the flood)
        declared = int(re.search(r"its answer was (\d+) bytes", result["error"]).group(1))
        assert FLOOD < declared < FLOOD + 200
    else:
        assert "its answer was more than 4194304 bytes" in result["error"]
    assert_worker_bounded(limited, before)


def test_an_answer_over_the_limit_from_the_sdk_is_a_tool_error_saying_so(
    cluster: Cluster, mcp_servers: McpServers, script: Any
) -> None:
    # the SDK's own answer over the limit (its JSON body has a Content-Length)
    _, entry = flood(script, {"answer_bytes": 5 * 1024 * 1024}, server="web")
    assert entry.outcome == "error", entry.payload
    result = entry.payload["result"]
    assert result["truncated"] is True
    assert "ran the call, but its answer was" in result["error"]
    assert "over the limit of 4194304 bytes" in result["error"]


def test_an_sse_event_over_the_limit_is_a_tool_error_saying_so(
    limited: Cluster, script: Any
) -> None:
    # an answer as one SSE event of gigabytes: the SDK's reader stops at the same limit
    before = settled(limited)
    _, entry = flood(script, {"result_bytes": FLOOD, "as_sse": True}, server="web")
    assert entry.outcome == "error", entry.payload
    result = entry.payload["result"]
    assert result["truncated"] is True
    assert "ran the call, but its answer was more than 4194304 bytes" in result["error"]
    assert_worker_bounded(limited, before)


def test_a_json_answer_within_the_limit_passes_whole(
    cluster: Cluster, mcp_servers: McpServers, script: Any
) -> None:
    # a JSON body (not SSE) under the limit: read by the bounded transport, handed on whole
    _, entry = flood(script, {"result_bytes": 100_000}, server="web")
    assert entry.outcome == "ok", entry.payload
    assert entry.payload["result"] == {
        "text": "x" * 100_000,
        "structured_content": {"result": "flooded"},
    }
