"""A hostile model's delegations through real workers: the depth and fan-out limits
(CHARLIE_DELEGATE_MAX_DEPTH, CHARLIE_DELEGATE_MAX_CHILDREN) refuse with a tool error the model
sees (I15), and a child never switches to a scripted model, whose script may sleep, append to
files and probe for them, unless its parent runs on one; a script's ledger stays beside it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import charlie
from charlie import api
from charlie.domain import TaskStatus
from charlie.models.scripted import ScriptError
from tests.support.cluster import Cluster
from tests.support.fake_openai import FakeOpenAI, chat_text, chat_tool_calls

pytestmark = pytest.mark.timeout(180)

#: the limits the workers of this module run with
MAX_DEPTH = 1
MAX_CHILDREN = 2


@pytest.fixture(scope="module")
def limited(cluster_session: Cluster) -> Iterator[Cluster]:
    """Workers whose operator allows any model for a child (``*``) and small delegation
    limits."""
    with cluster_session.configured(
        CHARLIE_DELEGATE_MODELS="*",
        CHARLIE_DELEGATE_MAX_DEPTH=str(MAX_DEPTH),
        CHARLIE_DELEGATE_MAX_CHILDREN=str(MAX_CHILDREN),
    ) as cluster:
        yield cluster


def call(cid: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": arguments}


def results(task_id: str) -> dict[str, Any]:
    return {i.call_id: i for i in charlie.transcript(task_id) if i.kind == "tool_result"}


def created(task_id: str) -> bool:
    try:
        api.get_task(task_id)
    except api.TaskNotFound:
        return False
    return True


def test_more_children_than_the_limit_are_refused_with_a_tool_error(
    limited: Cluster, cluster: Cluster, script
) -> None:
    """CHARLIE_DELEGATE_MAX_CHILDREN=2: three delegates in one turn, run at once, start two
    children; the third is a tool error naming the limit and the setting, and starts nothing
    (siblings are counted one submit at a time)."""
    child_model, _ = script([{"say": "child done"}])
    model, _ = script(
        [
            {
                "tool_calls": [
                    call(f"d{n}", "delegate", prompt=f"part {n}", model=child_model)
                    for n in range(3)
                ]
            },
            {"say": "done"},
        ]
    )
    parent = charlie.submit("fan out", model=model)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    shown = results(parent)
    refused = [cid for cid, item in shown.items() if item.outcome == "error"]
    assert len(refused) == 1, {cid: i.payload for cid, i in shown.items()}
    payload = shown[refused[0]].payload
    assert "CHARLIE_DELEGATE_MAX_CHILDREN=2" in payload["content"]
    assert "at most 2 child task" in payload["content"]
    assert not created(f"{parent}.0.{refused[0]}")
    assert len(charlie.list_tasks(parent=parent)) == MAX_CHILDREN


def test_a_child_past_the_depth_limit_is_refused_with_a_tool_error(
    limited: Cluster, cluster: Cluster, script
) -> None:
    """CHARLIE_DELEGATE_MAX_DEPTH=1: a submitted task may delegate, its child may not; the
    child's delegate is a tool error naming the limit and the setting."""
    grandchild_model, grandchild_ledger = script([{"say": "never"}])
    child_model, _ = script(
        [
            {"tool_calls": [call("d", "delegate", prompt="deeper", model=grandchild_model)]},
            {"say": "child done"},
        ]
    )
    model, _ = script(
        [
            {"tool_calls": [call("d", "delegate", prompt="one level", model=child_model)]},
            {"tool_calls": [call("w", "wait_for_task", task_id="{task_id}.0.d")]},
            {"say": "done"},
        ]
    )
    parent = charlie.submit("nest", model=model)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    child = f"{parent}.0.d"
    refused = results(child)["d"]
    assert refused.outcome == "error"
    assert "CHARLIE_DELEGATE_MAX_DEPTH=1" in refused.payload["content"]
    assert not created(f"{child}.0.d")
    assert not grandchild_ledger.exists()


def test_a_child_of_a_real_model_cannot_switch_to_a_scripted_one(
    limited: Cluster, cluster: Cluster, model_server: FakeOpenAI, script
) -> None:
    """With ``*`` in CHARLIE_DELEGATE_MODELS, a parent on an OpenAI-compatible model still
    cannot give its child a scripted model (a script sleeps, writes its ledger, probes for
    files): a tool error, and no child. The file named is not read: the refusal is the same
    whether it exists or not."""
    child_model, child_ledger = script([{"say": "scripted child ran"}])
    arguments = json.dumps({"prompt": "run my script", "model": child_model})
    probe = json.dumps({"prompt": "probe", "model": "scripted:/etc/shadow"})
    model_server.enqueue(
        chat_tool_calls([("d1", "delegate", arguments), ("d2", "delegate", probe)]),
        chat_text("refused, as it should be"),
    )
    parent = charlie.submit("escape to a script", model="openai:fake-model")
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    for cid in ("d1", "d2"):
        item = results(parent)[cid]
        assert item.outcome == "error", item.payload
        assert "scripted model" in item.payload["content"]
        assert "only when its parent runs on one" in item.payload["content"]
        assert not created(f"{parent}.0.{cid}")
    assert "Permission denied" not in results(parent)["d2"].payload["content"]
    assert not child_ledger.exists()


def escaping_script(tmp_path: Path, ledger: str) -> Path:
    scripts = tmp_path / f"scripts-{uuid.uuid4().hex[:8]}"
    scripts.mkdir()
    path = scripts / "child.json"
    path.write_text(json.dumps({"turns": [{"say": "ran"}], "ledger": ledger}))
    return path


def test_a_script_whose_ledger_leaves_its_directory_is_refused(
    limited: Cluster, cluster: Cluster, script, tmp_path: Path
) -> None:
    """A ledger is a path relative to its script's directory and stays in it: an absolute
    path, a ``..`` and a symlink out of it are refused with an error saying so, at submit and
    at a delegate (a tool error; no child, nothing appended)."""
    outside = tmp_path / "outside.jsonl"
    absolute = escaping_script(tmp_path, str(outside))
    with pytest.raises(ScriptError, match="is absolute"):
        charlie.submit("absolute ledger", model=f"scripted:{absolute}")
    dotdot = escaping_script(tmp_path, "../outside.jsonl")
    with pytest.raises(ScriptError, match=r"has a '\.\.'"):
        charlie.submit("dotdot ledger", model=f"scripted:{dotdot}")
    linked = escaping_script(tmp_path, "link/ledger.jsonl")
    (linked.parent / "link").symlink_to(tmp_path)
    with pytest.raises(ScriptError, match="outside the script's directory"):
        charlie.submit("symlinked ledger", model=f"scripted:{linked}")

    model, _ = script(
        [
            {
                "tool_calls": [
                    call("a", "delegate", prompt="x", model=f"scripted:{absolute}"),
                    call("l", "delegate", prompt="x", model=f"scripted:{linked}"),
                ]
            },
            {"say": "both refused"},
        ]
    )
    parent = charlie.submit("scripted parent", model=model)
    info = charlie.wait(parent, timeout=90)
    assert info.status is TaskStatus.SUCCEEDED, info.error
    shown = results(parent)
    assert shown["a"].outcome == "error" and "is absolute" in shown["a"].payload["content"]
    assert shown["l"].outcome == "error"
    assert "outside the script's directory" in shown["l"].payload["content"]
    for cid in ("a", "l"):
        assert not created(f"{parent}.0.{cid}")
    assert not outside.exists() and not (tmp_path / "ledger.jsonl").exists()
