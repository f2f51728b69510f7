"""The README's "run it for real" block, run as written: a worker and the beat on the embedded
default, a task submitted with the shell commands shown, calling the README's tool through an
OpenAI-compatible server (a real HTTP server on 127.0.0.1, CHARLIE_MODEL_BASE_URL), then listed
by `charlie list --search` and shown by `charlie show`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster import REPO
from tests.support.fake_openai import FakeOpenAI, chat_text, chat_tool_calls
from tests.unit.test_docs import EXAMPLES, README, _example_env

pytestmark = [pytest.mark.backend_free, pytest.mark.timeout(240)]


def _run_block() -> str:
    text = README.read_text()
    after = text[text.index("Then run it for real") :]
    return re.search(r"^```bash\n(.*?)^```", after, flags=re.S | re.M).group(1)  # type: ignore[union-attr]


def test_the_readme_run_block_works_as_written(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "labels.py", tmp_path / "labels.py")
    block = _run_block()
    assert "CHARLIE_TOOL_MODULES=labels" in block and "charlie worker &" in block
    with FakeOpenAI() as server:
        server.enqueue(
            chat_tool_calls(
                [("c1", "print_label", json.dumps({"order_id": "A17", "address": "1 Main St"}))]
            ),
            chat_text("The label for A17 is printed."),
        )
        env = _example_env(tmp_path)
        env.pop("CHARLIE_HOME")  # as a newcomer runs it: ./.charlie in this directory
        env["CHARLIE_MODEL_BASE_URL"] = server.url
        script = (
            "set -e\n"
            # the worker and the beat the block starts in the background end with the test
            "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n" + block
        )
        run = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
        )
        bodies = server.bodies
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert len(bodies) == 2, out
    result = next(m for m in bodies[1]["messages"] if m["role"] == "tool")
    assert "labels/A17.txt" in result["content"]
    assert "succeeded" in run.stdout
    assert run.stdout.count("ship-a17") >= 2, out  # listed by the search, and shown
    assert "The label for A17 is printed." in run.stdout
    # the block's `cat` (under set -e) found the label where the pages say a task's default
    # workspace is: ./.charlie/workspaces/TASK_ID
    assert "cat .charlie/workspaces/ship-a17/labels/A17.txt" in block
    label = tmp_path / ".charlie" / "workspaces" / "ship-a17" / "labels" / "A17.txt"
    assert label.read_text() == "1 Main St"
    assert not list((REPO / ".charlie").glob("ship-a17*"))


def test_getting_started_shows_the_same_lines() -> None:
    page = (REPO / "docs" / "getting-started.md").read_text()
    assert f"```bash\n{_run_block()}```" in page
