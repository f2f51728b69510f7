"""The README's no-API-key path, run as written: in a copy of docs/examples/, a worker and the
beat on the embedded default, a task whose model is docs/examples/turns.json (a scripted model)
and whose print_label call waits for a person's approval; `charlie watch --until-waiting`
stops at the wait, `charlie approve` lets the call run, `charlie watch` follows the task to its
end and `charlie show` prints its transcript."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_docs import EXAMPLES, README, _example_env

pytestmark = [pytest.mark.backend_free, pytest.mark.timeout(240)]


def _no_key_block() -> str:
    text = README.read_text()
    after = text[text.index("<!-- the no-API-key path") :]
    found = re.search(r"^```bash\n(.*?)^```", after, flags=re.S | re.M)
    assert found is not None
    return found.group(1)


def test_the_readme_no_key_path_works_as_written(tmp_path: Path) -> None:
    block = _no_key_block()
    assert block.startswith("cd docs/examples")
    shutil.copytree(EXAMPLES, tmp_path / "docs" / "examples")  # a clone's, as far as it matters
    env = _example_env(tmp_path)
    env.pop("CHARLIE_HOME")  # as a newcomer runs it: ./.charlie in that directory
    for key in [k for k in env if k.startswith(("OPENAI", "ANTHROPIC"))]:
        env.pop(key)  # no API key
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
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "waiting for a person: an approval of print_label (call label-1)" in run.stdout, out
    assert "succeeded: " in run.stdout and "The label for order A17 is printed" in run.stdout
    assert "print_label" in run.stdout and "[ok, " in run.stdout, out  # charlie show's row
    label = tmp_path / "docs/examples/.charlie/workspaces/ship-a17/labels/A17.txt"
    assert label.read_text() == "1 Main St"


def test_readme_and_contributing_give_the_same_test_urls() -> None:
    contributing = (README.parent / "CONTRIBUTING.md").read_text()
    urls = re.findall(r"CHARLIE_TEST_(?:DATABASE|BROKER)_URL=(\S+)", README.read_text())
    assert len(urls) == 2
    for url in urls:
        assert url in contributing, f"CONTRIBUTING.md does not give the README's {url}"
