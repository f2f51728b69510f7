"""The devbox's own git never runs a program the agent configured.

An agent can write its workspace's ``.git/config`` (with ``run_command``), files the config
includes and ``.gitattributes`` (with the file tools). Each test plants one program-running
mechanism whose program would create a marker file, drives the devbox operations that would
honour it (``git_diff``, ``git_commit``, ``apply_patch``, ``find_commit``), and checks that the
marker never appears and that the operation either works or refuses with an error naming the
key to remove.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from charlie.devbox import DevboxClient, DevboxError, DevboxServer, RepoPolicy
from tests.devbox.conftest import TOKEN, ServerFactory
from tests.support.cluster import TEST_SANDBOX

_PATCH = "--- /dev/null\n+++ b/patched.txt\n@@ -0,0 +1 @@\n+patched\n"


def _git(cwd: Path, *args: str) -> str:
    # the test's own git, standing in for what an agent's command could run in its workspace
    return subprocess.run(
        ["git", "-c", "user.name=T", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def ws(client: DevboxClient, workspace: str) -> Path:
    path = Path(client.get_workspace(workspace).path)
    (path / "data.txt").write_text("one\n")
    client.commit(workspace, "data", "k-data")
    return path


@pytest.fixture
def evil(tmp_path: Path) -> tuple[Path, Path]:
    """A program that records that it ran (then passes its input through, like a filter)."""
    marker = tmp_path / "agent-program-ran"
    script = tmp_path / "evil.sh"
    script.write_text(f'#!/bin/sh\necho "$0 $*" >> "{marker}"\ncat\n')
    script.chmod(0o755)
    return script, marker


Op = Callable[[DevboxClient, str], object]

_OPS: dict[str, Op] = {
    "git_diff": lambda c, w: c.diff(w),
    "git_commit": lambda c, w: c.commit(w, "agent change", "k-op"),
    "apply_patch": lambda c, w: c.apply_patch(w, _PATCH),
    "find_commit": lambda c, w: c.find_commit(w, "k-data"),
}


def _run_every_op(client: DevboxClient, workspace: str, ws: Path) -> dict[str, str]:
    """Run each devbox git operation; what each did: "ok" or the refusal's message."""
    outcomes: dict[str, str] = {}
    for name, op in _OPS.items():
        (ws / "data.txt").write_text(f"changed before {name}\n")  # give diff and add work to do
        try:
            op(client, workspace)
            outcomes[name] = "ok"
        except DevboxError as exc:
            assert exc.status == 409, f"{name}: {exc}"
            outcomes[name] = exc.message
    return outcomes


@pytest.mark.parametrize("variable", ["clean", "smudge", "process"])
def test_filter_driver_in_repo_config_is_refused(
    client: DevboxClient, workspace: str, ws: Path, evil: tuple[Path, Path], variable: str
) -> None:
    script, marker = evil
    (ws / ".gitattributes").write_text("* filter=evil\n")
    _git(ws, "config", f"filter.evil.{variable}", str(script))
    outcomes = _run_every_op(client, workspace, ws)
    assert not marker.exists(), marker.read_text()
    for name in ("git_diff", "git_commit", "apply_patch"):
        assert f"filter.evil.{variable}" in outcomes[name], outcomes
        assert "git config --unset" in outcomes[name]
    # reconcile must keep answering: reading history honours no filter
    assert outcomes["find_commit"] == "ok"


def test_filter_written_by_an_agent_command_is_refused(
    client: DevboxClient, workspace: str, ws: Path, evil: tuple[Path, Path]
) -> None:
    script, marker = evil
    client.write_file(workspace, ".gitattributes", "*.txt filter=lfsish\n")
    started = client.start_command(
        workspace, argv=["git", "config", "filter.lfsish.clean", str(script)]
    )
    status = client.wait_command(started.execution_id, timeout=30)
    client.write_file(workspace, "data.txt", "two\n")
    if TEST_SANDBOX == "bwrap":
        # In the sandbox .git/config is read-only: the command cannot plant the driver at all
        # (no race with the devbox's check is left), and the commit runs no filter.
        assert not status.succeeded, status
        assert client.commit(workspace, "agent change", "k-agent").created
    else:
        assert status.succeeded, status
        with pytest.raises(DevboxError) as info:
            client.commit(workspace, "agent change", "k-agent")
        assert info.value.status == 409 and "filter.lfsish.clean" in info.value.message
    assert not marker.exists()


@pytest.mark.parametrize(
    "include",
    [
        ("include.path", "../agent.cfg"),
        ("includeIf.gitdir:/.path", "../agent.cfg"),
    ],
)
def test_config_included_from_the_worktree_is_checked(
    client: DevboxClient,
    workspace: str,
    ws: Path,
    evil: tuple[Path, Path],
    include: tuple[str, str],
) -> None:
    # write_file cannot reach .git, but an include can point at a file it can write
    script, marker = evil
    client.write_file(workspace, "agent.cfg", f'[filter "x"]\n\tclean = {script}\n')
    client.write_file(workspace, ".gitattributes", "* filter=x\n")
    _git(ws, "config", *include)
    outcomes = _run_every_op(client, workspace, ws)
    assert not marker.exists()
    assert "filter.x.clean" in outcomes["git_commit"], outcomes


def test_textconv_is_not_run_by_git_diff(
    client: DevboxClient, workspace: str, ws: Path, evil: tuple[Path, Path]
) -> None:
    script, marker = evil
    (ws / ".gitattributes").write_text("*.txt diff=conv\n")
    client.commit(workspace, "attributes", "k-attr")
    _git(ws, "config", "diff.conv.textconv", str(script))
    (ws / "data.txt").write_text("two\n")
    diff = client.diff(workspace)
    assert not marker.exists()
    assert "-one\n+two" in diff.diff  # git's own text diff, not the agent's program


def test_signature_verification_is_not_run_by_find_commit(
    client: DevboxClient, workspace: str, ws: Path, evil: tuple[Path, Path]
) -> None:
    # an agent can craft a "signed" commit without any key, and ask git to verify it on log
    script, marker = evil
    tree = _git(ws, "write-tree")
    parent = _git(ws, "rev-parse", "HEAD")
    body = (
        f"tree {tree}\nparent {parent}\nauthor a <a@a> 1 +0000\ncommitter a <a@a> 1 +0000\n"
        "gpgsig -----BEGIN PGP SIGNATURE-----\n \n abc\n -----END PGP SIGNATURE-----\n\n"
        "signed\n\nCharlie-Idempotency-Key: k-signed\n"
    )
    sha = subprocess.run(
        ["git", "hash-object", "-t", "commit", "-w", "--stdin"],
        cwd=ws,
        input=body,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    _git(ws, "update-ref", "HEAD", sha)
    for key in ("gpg.program", "gpg.openpgp.program"):
        _git(ws, "config", key, str(script))
    _git(ws, "config", "log.showSignature", "true")
    assert client.find_commit(workspace, "k-signed") == sha
    assert client.commit(workspace, "more", "k-after-signed").created
    assert not marker.exists()


def test_core_worktree_cannot_point_git_outside_the_workspace(
    client: DevboxClient, workspace: str, ws: Path, tmp_path: Path
) -> None:
    # with core.worktree elsewhere, "git add -A" would commit another directory's files
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.txt").write_text("not the agent's\n")
    _git(ws, "config", "core.worktree", str(outside))
    client.write_file(workspace, "mine.txt", "mine\n")
    assert client.diff(workspace).untracked == ("mine.txt",)
    client.apply_patch(workspace, _PATCH)
    assert (ws / "patched.txt").is_file() and not (outside / "patched.txt").exists()
    result = client.commit(workspace, "mine", "k-mine")
    names = _git(ws, "--work-tree", str(ws), "ls-tree", "-r", "--name-only", result.commit)
    assert "secret.txt" not in names.split("\n")
    assert {"mine.txt", "patched.txt"} <= set(names.split("\n"))


@pytest.mark.parametrize(
    "settings",
    [
        {"core.fsmonitor": "{script}"},
        {"core.pager": "{script}", "pager.diff": "{script}", "pager.log": "{script}"},
        {"core.editor": "{script}", "sequence.editor": "{script}", "commit.verbose": "true"},
        {"diff.external": "{script}"},
        {"core.hooksPath": "{hooks}"},
        {"commit.gpgSign": "true", "gpg.program": "{script}"},
        {"credential.helper": "{script}", "core.askPass": "{script}"},
        {"core.sshCommand": "{script}", "remote.origin.url": "ssh://example.invalid/r"},
        {"protocol.ext.allow": "always"},
    ],
    ids=lambda s: "+".join(s),
)
def test_other_program_keys_are_neutralized(
    client: DevboxClient,
    workspace: str,
    ws: Path,
    evil: tuple[Path, Path],
    tmp_path: Path,
    settings: dict[str, str],
) -> None:
    script, marker = evil
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in (
        "pre-commit",
        "commit-msg",
        "post-commit",
        "post-checkout",
        "reference-transaction",
    ):
        (hooks / name).symlink_to(script)
    (ws / ".gitattributes").write_text("* diff=ext\n")
    _git(ws, "config", "diff.ext.command", str(script))
    for key, value in settings.items():
        _git(ws, "config", key, value.format(script=script, hooks=hooks))
    outcomes = _run_every_op(client, workspace, ws)
    assert not marker.exists(), marker.read_text()
    # these are overridden, not refused: the agent may keep them for its own git
    assert set(outcomes.values()) == {"ok"}, outcomes


def test_devbox_user_global_config_is_not_read(
    client: DevboxClient,
    workspace: str,
    ws: Path,
    evil: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an unsandboxed command can write the devbox user's ~/.gitconfig; the devbox ignores it
    script, marker = evil
    home = tmp_path / "home"
    (home / "xdg" / "git").mkdir(parents=True)
    for config in (home / ".gitconfig", home / "xdg" / "git" / "config"):
        config.write_text(f'[filter "g"]\n\tclean = {script}\n\tsmudge = {script}\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg"))
    (ws / ".gitattributes").write_text("* filter=g\n")
    assert set(_run_every_op(client, workspace, ws).values()) == {"ok"}
    assert not marker.exists()


def test_ext_transport_clone_is_refused(
    client: DevboxClient,
    server: DevboxServer,
    evil: tuple[Path, Path],
    make_server: ServerFactory,
) -> None:
    script, marker = evil
    # the repository policy refuses it first (no allowed root or pattern matches)...
    with pytest.raises(DevboxError) as info:
        client.ensure_workspace("ext", f"ext::{script}")
    assert info.value.status == 403
    # ...and a devbox whose operator allowed it anyway still has git refuse the transport
    client.close()
    server.stop()  # the root is one devbox's at a time
    allowing_server = make_server(repos=RepoPolicy(("ext::*",)))
    with DevboxClient(allowing_server.url, TOKEN) as allowing, pytest.raises(DevboxError) as info:
        allowing.ensure_workspace("ext", f"ext::{script}")
    assert info.value.status == 422
    assert not marker.exists()


def test_harmless_repo_config_is_left_alone(client: DevboxClient, workspace: str, ws: Path) -> None:
    for key, value in (("alias.st", "status"), ("color.ui", "always"), ("user.name", "Agent")):
        _git(ws, "config", key, value)
    assert set(_run_every_op(client, workspace, ws).values()) == {"ok"}


def test_symlinked_git_dir_is_refused(client: DevboxClient, workspace: str, ws: Path) -> None:
    # .git pointing at another workspace's repository would commit into that one
    client.ensure_workspace("other", None)
    other = Path(client.get_workspace("other").path)
    before = _git(other, "rev-parse", "HEAD")
    real = ws.parent / "ws-real-git"
    (ws / ".git").rename(real)
    (ws / ".git").symlink_to(other / ".git")
    with pytest.raises(DevboxError) as info:
        client.commit(workspace, "into the other", "k-other")
    assert info.value.status == 409 and "symlink" in info.value.message
    assert _git(other, "rev-parse", "HEAD") == before
