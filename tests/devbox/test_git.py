"""Workspaces as git checkouts: creation, patches, diffs and idempotent commits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from charlie.devbox import DevboxClient, DevboxError, DevboxServer


def _git(cwd: Path | str, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=T", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def upstream(tmp_path: Path) -> Path:
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "README.md").write_text("one\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    (repo / "README.md").write_text("two\n")
    _git(repo, "commit", "-q", "-am", "second")
    _git(repo, "branch", "feature")
    return repo


def test_clone_idempotent_and_conflict(client: DevboxClient, upstream: Path) -> None:
    first = _git(upstream, "rev-list", "--max-parents=0", "HEAD")
    ws = client.ensure_workspace("c1", str(upstream), branch="work", base_commit=first)
    assert (ws.head, ws.branch) == (first, "work")
    assert client.ensure_workspace("c1", str(upstream), branch="work", base_commit=first) == ws
    assert client.get_workspace("c1") == ws
    with pytest.raises(DevboxError) as info:
        client.ensure_workspace("c1", str(upstream))
    assert info.value.status == 409
    feature = client.ensure_workspace("c2", str(upstream), branch="feature")
    assert (feature.branch, feature.head) == ("feature", _git(upstream, "rev-parse", "feature"))
    assert client.read_file("c2", "README.md").content == "two\n"
    with pytest.raises(DevboxError) as info:
        client.get_workspace("missing")
    assert info.value.status == 404
    with pytest.raises(DevboxError) as info:
        client.ensure_workspace("bad", str(upstream.parent / "no-such-repo"))
    assert info.value.status == 422
    with pytest.raises(DevboxError) as info:
        client.ensure_workspace("..", None)
    assert info.value.status in (400, 404)


def test_copy_from(client: DevboxClient, tmp_path: Path) -> None:
    src = tmp_path / "sample"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    ws = client.ensure_workspace("copy", copy_from=str(src))
    assert ws.head is not None and ws.branch == "main"
    assert client.read_file("copy", "pkg/mod.py").content == "x = 1\n"
    assert client.diff("copy").diff == ""  # the copy is committed


def test_apply_patch_good_and_bad(client: DevboxClient, workspace: str) -> None:
    client.write_file(workspace, "a.txt", "alpha\nbeta\n")
    client.commit(workspace, "add a", "k-add")
    good = (
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n alpha\n-beta\n+gamma\n"
        "--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+hello\n"
    )
    result = client.apply_patch(workspace, good)
    assert result.files == ("a.txt", "new.txt")
    assert client.read_file(workspace, "a.txt").content == "alpha\ngamma\n"
    assert client.read_file(workspace, "new.txt").content == "hello\n"

    stale = "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n alpha\n-beta\n+delta\n"
    with pytest.raises(DevboxError) as info:
        client.apply_patch(workspace, stale)
    assert info.value.status == 422 and "does not apply" in info.value.message
    assert client.read_file(workspace, "a.txt").content == "alpha\ngamma\n"  # untouched
    with pytest.raises(DevboxError) as info:
        client.apply_patch(workspace, "this is not a diff")
    assert info.value.status == 422
    escape = "--- /dev/null\n+++ b/../escape.txt\n@@ -0,0 +1 @@\n+x\n"
    with pytest.raises(DevboxError) as info:
        client.apply_patch(workspace, escape)
    assert info.value.status == 422


def test_diff_shows_changes_and_untracked(client: DevboxClient, workspace: str) -> None:
    client.write_file(workspace, "tracked.txt", "v1\n")
    client.commit(workspace, "track", "k-track")
    client.write_file(workspace, "tracked.txt", "v2\n")
    client.write_file(workspace, "fresh/new.txt", "n\n")
    diff = client.diff(workspace)
    assert "-v1\n+v2" in diff.diff
    assert diff.untracked == ("fresh/new.txt",)
    assert not diff.truncated


def test_commit_is_idempotent_by_key(client: DevboxClient, workspace: str) -> None:
    root = client.get_workspace(workspace).path
    before = int(_git(root, "rev-list", "--count", "HEAD"))
    assert client.find_commit(workspace, "run-1:call-7") is None

    client.write_file(workspace, "out.txt", "result\n")
    first = client.commit(workspace, "Agent change\n\nDetails here.", "run-1:call-7")
    assert first.created
    again = client.commit(workspace, "Agent change\n\nDetails here.", "run-1:call-7")
    assert (again.commit, again.created) == (first.commit, False)
    assert int(_git(root, "rev-list", "--count", "HEAD")) == before + 1

    assert client.find_commit(workspace, "run-1:call-7") == first.commit
    assert client.find_commit(workspace, "run-1:call-") is None  # exact, not a prefix
    message = _git(root, "log", "-1", "--format=%B")
    assert message.endswith("Charlie-Idempotency-Key: run-1:call-7")
    assert _git(root, "log", "-1", "--format=%an <%ae>") == "Charlie <charlie@localhost>"
    assert client.diff(workspace).untracked == ()

    # a later commit with another key is a new commit; the old key still finds the old one
    client.write_file(workspace, "out.txt", "more\n")
    second = client.commit(workspace, "Another", "run-1:call-8")
    assert second.created and second.commit != first.commit
    assert client.find_commit(workspace, "run-1:call-7") == first.commit


def test_commit_ignores_workspace_hooks(client: DevboxClient, workspace: str) -> None:
    # an agent could plant a hook with a command; the devbox's git must not run it
    hook = Path(client.get_workspace(workspace).path) / ".git" / "hooks" / "pre-commit"
    hook.write_text('#!/bin/sh\ntouch "$HOME/../hook-ran"\nexit 1\n')
    hook.chmod(0o755)
    assert client.commit(workspace, "with hook present", "k-hook").created
    assert not (hook.parents[3] / "hook-ran").exists()


def test_bad_commit_requests(client: DevboxClient, workspace: str) -> None:
    for message, key in (("", "k"), ("m", ""), ("m", "has space")):
        with pytest.raises(DevboxError) as info:
            client.commit(workspace, message, key)
        assert info.value.status == 400


def test_find_commit_waits_for_a_commit_in_progress(
    server: DevboxServer, client: DevboxClient, workspace: str
) -> None:
    """A reconcile's read-back takes the workspace lock that a commit holds
    for its whole length, so it never answers "not committed" in the middle of one."""
    import threading

    answers: list[str | None] = []
    lock = server.devbox.workspaces.lock(workspace)
    with lock:  # a commit is in progress
        reader = threading.Thread(
            target=lambda: answers.append(client.find_commit(workspace, "key-in-flight"))
        )
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and answers == []  # waiting for the commit to finish
    reader.join(10)
    assert answers == [None]


def test_a_reconcile_that_finds_no_commit_seals_the_key(
    client: DevboxClient, workspace: str
) -> None:
    """A reconcile's "not committed" stays true. A holder paused before its
    commit reached the devbox must not commit with the key once a reconcile found nothing."""
    assert client.find_commit(workspace, "call-late", seal=True) is None
    with pytest.raises(DevboxError) as refused:
        client.commit(workspace, "late", "call-late")
    assert refused.value.status == 409
    assert "sealed" in refused.value.message
    assert client.find_commit(workspace, "call-late") is None  # nothing was committed
    # a plain look (not a reconcile) seals nothing
    assert client.find_commit(workspace, "call-fresh") is None
    assert client.commit(workspace, "fresh", "call-fresh").created
