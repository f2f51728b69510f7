"""The producer face needs the database and the broker only (dbos-transact-py's client is the
model): a web app that calls ``charlie.submit`` imports neither the worker's tool modules
(CHARLIE_TOOL_MODULES) nor the executor, the sweeps or the worker shell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PRODUCER = r"""
import json, sys
import charlie
from charlie.api import UnknownToolError

model, mode = sys.argv[1], sys.argv[2]
tools = {"builtins": ["read_file", "write_file"], "none": None, "user": ["shout"],
         "unknown": ["read_file", "launch_rockets"]}[mode]
try:
    task_id = charlie.submit("hello", model=model, tools=tools, task_id="t-" + mode)
    info = charlie.get_task(task_id)
    outcome = {"task": task_id, "status": info.status.value}
except UnknownToolError as exc:
    outcome = {"refused": str(exc)}
engine = sorted(
    m for m in sys.modules
    if m in ("charlie.worker", "charlie.sweeps") or m.startswith("charlie.executor")
)
imported = "producer_face_tools" in sys.modules
print(json.dumps({**outcome, "engine": engine, "tools_imported": imported}))
"""

TOOL_MODULE = """
import charlie

@charlie.tool
def shout(text: str) -> str:
    '''Shouts.'''
    return text.upper()
"""


def run_producer(tmp_path: Path, mode: str) -> dict[str, object]:
    (tmp_path / "producer_face_tools.py").write_text(TOOL_MODULE)
    script = tmp_path / "turns.json"
    script.write_text(json.dumps({"turns": [{"say": "hi"}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env.update(
        {
            # SQLite and the embedded broker under a home of its own: no cluster runs here.
            "CHARLIE_HOME": str(tmp_path / "home"),
            "CHARLIE_TOOL_MODULES": "producer_face_tools",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
        }
    )
    out = subprocess.run(
        [sys.executable, "-c", PRODUCER, f"scripted:{script}", mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_submit_with_built_in_tools_imports_no_tool_module_and_no_executor(
    tmp_path: Path,
) -> None:
    for mode in ("builtins", "none"):
        result = run_producer(tmp_path, mode)
        assert result["status"] == "queued", result
        assert result["engine"] == [], result
        assert result["tools_imported"] is False, result


def test_an_unknown_tool_is_still_refused_at_submit(tmp_path: Path) -> None:
    result = run_producer(tmp_path, "unknown")
    assert "launch_rockets" in str(result["refused"]), result
    assert "shout" in str(result["refused"]), result  # the worker's tools are listed
    assert result["engine"] == [], result


def test_a_user_tool_is_known_once_its_module_is_consulted(tmp_path: Path) -> None:
    # A name the producer does not know sends it to CHARLIE_TOOL_MODULES (see
    # api.unknown_tools); still nothing of the engine.
    result = run_producer(tmp_path, "user")
    assert result["status"] == "queued", result
    assert result["tools_imported"] is True, result
    assert result["engine"] == [], result
