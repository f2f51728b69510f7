"""Model and tool text never controls the operator's terminal: what `charlie` prints of a
task (its answer, a tool's result, a question, a call id a model made up, a person's note) shows
every control and format character instead of passing it on (charlie.terminal). Real `charlie`
processes against the suite's cluster, with a scripted model whose answer, tool results,
question and call id carry OSC 52 (clipboard write), a screen clear, CR, backspace, the 8-bit
CSI, DEL and a right-to-left override."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
import uuid

import pytest

import charlie
from charlie.domain import TaskStatus
from charlie.scheduler import TaskNotFound
from tests.conftest import wait_for
from tests.integration.test_production_path import charlie_cli
from tests.support.cluster import REPO, Cluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.backend_free]

#: OSC 52 (set the clipboard), clear the screen and home the cursor, CR, backspace, 8-bit CSI,
#: RIGHT-TO-LEFT OVERRIDE, DEL.
EVIL = "A\x1b]52;c;aGFja2Vk\x07B\x1b[2J\x1b[HC\rD\x08E\x9b31mF\u202eG\x7fH"
#: how each of them must be shown
VISIBLE = ("\\x1b]52;c;aGFja2Vk\\x07", "\\x1b[2J\\x1b[H", "C\\rD\\x08E", "\\x9b31m", "<U+202E>")
#: how they are shown in a task's result, a JSON object (JSON escapes C0 controls itself)
IN_RESULT = ("\\u001b]52;c;aGFja2Vk\\u0007", "\\x9b31m", "<U+202E>", "G\\x7fH")


def obeyable(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on rather than show (\\n and \\t aside)."""
    return [
        repr(ch)
        for ch in text
        if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")
    ]


def waiting_for(task_id: str) -> list[object]:
    try:
        return list(charlie.get_task(task_id).waiting_for)
    except TaskNotFound:  # `charlie submit` has not written it yet
        return []


def harmless(done: subprocess.CompletedProcess[str], *, shows: tuple[str, ...] = VISIBLE) -> str:
    for stream in (done.stdout, done.stderr):
        assert not obeyable(stream), (obeyable(stream), stream)
    for form in shows:
        assert form in done.stdout, (form, done.stdout)
    return done.stdout


def test_no_control_character_of_a_model_or_tool_reaches_the_terminal(
    cluster: Cluster,
    script,  # type: ignore[no-untyped-def]
) -> None:
    """submit --wait, status, show, reply, approve, wait and list print the hostile text made
    visible; before charlie.terminal, OSC 52, CR, the 8-bit CSI and U+202E went out raw."""
    approval_id = "w" + EVIL
    look = {"seconds": 0, "value": EVIL}
    model, _ = script(
        [
            {
                "say": "looking" + EVIL,
                "tool_calls": [
                    {"id": "look", "name": "sleep_then", "arguments": look},
                    {"id": "q", "name": "ask_human", "arguments": {"question": "which?" + EVIL}},
                    {"id": approval_id, "name": "ledger_write", "arguments": {"key": EVIL}},
                ],
            },
            {"say": "line one\n" + EVIL + "\nline three", "tool_calls": []},
        ]
    )  # fmt: skip
    env = {**cluster.settings_env, "CHARLIE_OPERATOR": "op-term"}
    task_id = f"term-{uuid.uuid4().hex[:10]}"
    full = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    waiting = subprocess.Popen(
        [sys.executable, "-m", "charlie", "submit", "hostile", "--model", model,
         "--task-id", task_id, "--approve", "ledger_write", "--wait", "--timeout", "150"],
        env={**full, **env, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: len(waiting_for(task_id)) == 2, timeout=90)
        wait_for(lambda: any(c.result is not None for c in charlie.calls(task_id)), timeout=60)

        status = harmless(charlie_cli(env, "status", task_id), shows=VISIBLE)
        assert "a reply to q: which?A\\x1b]52;c;" in status, status
        assert "an approval of wA\\x1b]52;c;" in status, status

        shown = harmless(charlie_cli(env, "show", task_id), shows=VISIBLE)
        assert "waiting for a reply to q: which?A\\x1b]52" in shown, shown

        replied = charlie_cli(env, "reply", task_id, "q", "this one" + EVIL)
        assert replied.returncode == 0, replied.stderr
        harmless(replied, shows=("reply by op-term",))
        approved = charlie_cli(env, "approve", task_id, approval_id, "--note", "ok" + EVIL)
        assert approved.returncode == 0, approved.stderr
        harmless(approved, shows=("approve by op-term",))
        refused = charlie_cli(env, "approve", task_id, approval_id)
        assert refused.returncode == 2
        assert not obeyable(refused.stderr), refused.stderr

        out, err = waiting.communicate(timeout=150)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.communicate()
    submitted = subprocess.CompletedProcess(waiting.args, waiting.returncode, out, err)
    assert submitted.returncode == 0, (out, err)
    harmless(submitted, shows=IN_RESULT)
    assert out.endswith('H\\nline three", "final_seq": 9}\n'), out
    assert charlie.get_task(task_id).status is TaskStatus.SUCCEEDED

    harmless(charlie_cli(env, "wait", task_id, "--timeout", "30"), shows=IN_RESULT)
    harmless(charlie_cli(env, "status", task_id), shows=IN_RESULT)
    shown = harmless(charlie_cli(env, "show", task_id))
    # the final answer keeps its lines, each further one indented under the row
    assert "final: line one\n" in shown, shown
    assert "\n        | A\\x1b]52;c;" in shown and "\n        | line three" in shown, shown
    assert "approve   by op-term" in shown and "call wA\\x1b]52;c;" in shown, shown
    assert "note: okA\\x1b]52;c;" in shown, shown
    # the JSON forms escape every control character already
    doc = charlie_cli(env, "show", task_id, "--json")
    assert doc.returncode == 0 and not obeyable(doc.stdout)
    listed = charlie_cli(env, "list", "--limit", "5")
    assert listed.returncode == 0 and not obeyable(listed.stdout + listed.stderr)


def test_tools_and_doctor_show_an_mcp_servers_words_without_obeying_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`charlie tools` and `charlie doctor` start the configured MCP servers to list them: a
    server's stderr (forwarded to the command's own) and its command line in the listing carry
    OSC 52, CR and U+202E, shown and not obeyed. Before charlie.terminal they went out raw."""
    noise = "printf '\\033]52;c;aGk=\\007 noise\\r\\342\\200\\256x\\n' >&2; exit 1"
    servers = {"mcpServers": {"loud": {"command": "sh", "args": ["-c", noise, "A" + EVIL]}}}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")},
        "CHARLIE_HOME": str(tmp_path / "home"),
        "CHARLIE_MCP_SERVERS": json.dumps(servers),
        "CHARLIE_MCP_TIMEOUT": "5",
        "PYTHONPATH": str(REPO),
    }
    for args in (["tools"], ["doctor", "--timeout", "2"]):
        done = subprocess.run(
            [sys.executable, "-m", "charlie", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for stream in (done.stdout, done.stderr):
            assert not obeyable(stream), (args, obeyable(stream), stream)
        assert "\\x1b]52;c;aGk=\\x07 noise\\r<U+202E>x" in done.stderr, (args, done.stderr)
        if args == ["tools"]:
            assert "mcp server loud" in done.stdout and "AA\\x1b]52;c;aGFja2Vk" in done.stdout
