"""The file event stream (the embedded default's) never stalls a reader on a long line: every
event is written within MAX_EVENT_BYTES (a ``waiting`` event listing hundreds of held calls is
split into parts, any other cut), a full file's pad is blank lines within the bound, and a reader
takes a line of any length (one an older writer left), then the events after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from charlie.streams.base import bound_event, encode
from charlie.streams.files import MAX_EVENT_BYTES, READ_CHUNK, FileTransport

pytestmark = pytest.mark.backend_free


def _waiting(calls: int, question: int = 3000) -> dict[str, object]:
    held = [
        {"call_id": f"c{i}", "name": "ask_human", "hold": "reply", "question": "q" * question}
        for i in range(calls)
    ]
    return {"type": "waiting", "id": "w1", "task_id": "t", "at": 1.0, "turn": 0, "calls": held}


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _read_all(files: FileTransport, task_id: str) -> list[dict[str, object]]:
    seen, after = [], None
    while True:
        batch = files.read(task_id, after, 0.0)
        if not batch:
            return seen
        seen += [e.data for e in batch]
        after = batch[-1].offset


def test_a_waiting_event_of_500_calls_is_split_within_the_bound(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=20000)
    files.append("t", [_waiting(500)])
    files.append("t", [{"type": "verdict", "id": "v", "task_id": "t", "call_id": "c7"}])
    assert all(len(line) <= MAX_EVENT_BYTES for line in _lines(files.path("t")))
    events = _read_all(files, "t")
    parts = [e for e in events if e["type"] == "waiting"]
    assert len(parts) > 1 and {e["parts"] for e in parts} == {len(parts)}
    assert [c["call_id"] for e in parts for c in e["calls"]] == [f"c{i}" for i in range(500)]
    assert len({e["id"] for e in parts}) == len(parts)
    assert events[-1]["type"] == "verdict"


def test_any_event_too_long_is_cut_and_says_so() -> None:
    event = {
        "type": "tool_call",
        "id": "x",
        "arguments": "a" * 500_000,
        "extra": {"k": "v" * 10**5},
    }
    [cut] = bound_event(event, MAX_EVENT_BYTES)
    assert len(encode(cut).encode()) <= MAX_EVENT_BYTES and cut["clipped"] is True
    assert cut["type"] == "tool_call" and cut["id"] == "x"
    one_huge_call = _waiting(1, question=10**6)
    [part] = bound_event(one_huge_call, MAX_EVENT_BYTES)
    assert len(encode(part).encode()) <= MAX_EVENT_BYTES
    assert part["calls"][0]["call_id"] == "c0"  # type: ignore[index]
    small = {"type": "text", "id": "s", "text": "hi"}
    assert bound_event(small, MAX_EVENT_BYTES) == [small]


def test_a_reader_takes_a_line_longer_than_its_chunk_and_what_follows(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=20000)
    files.append("t", [{"type": "model_start", "id": "a", "task_id": "t"}])
    # what a writer before the bound left: one event longer than a reader's chunk
    with open(files.path("t"), "ab") as f:
        f.write(encode(_waiting(600)).encode() + b"\n")
    assert max(len(line) for line in _lines(files.path("t"))) > READ_CHUNK
    files.append("t", [{"type": "end", "id": "e", "task_id": "t"}])
    events = _read_all(files, "t")
    assert [e["type"] for e in events] == ["model_start", "waiting", "end"]
    assert len(events[1]["calls"]) == 600  # type: ignore[arg-type]


def test_a_full_files_pad_is_lines_within_the_bound(tmp_path: Path) -> None:
    files = FileTransport(tmp_path, ttl=60, max_events=2000)  # about 1 MB
    files.append("t", [{"type": "text", "id": "x", "task_id": "t", "text": "y" * 900}])
    for n in range(1200):
        files.append("t", [{"type": "text", "id": f"d{n}", "task_id": "t", "text": "z" * 900}])
    files.append("t", [{"type": "final", "id": "f", "task_id": "t", "text": "done"}])
    assert all(len(line) <= MAX_EVENT_BYTES for line in _lines(files.path("t")))
    kinds = [e["type"] for e in _read_all(files, "t")]
    assert kinds.count("truncated") == 1 and kinds[-1] == "final"
