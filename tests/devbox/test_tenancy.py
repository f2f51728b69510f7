"""Tenancy in the devbox, against real servers over HTTP.

A workspace's credential (derived from the operator token) opens that workspace and its
commands only; the operator token opens everything. Workspaces are cloned or copied only from
the roots and URL patterns the operator allows (``--allow-repo``); nothing by default.
"""

from __future__ import annotations

import hashlib
import hmac
import subprocess
from pathlib import Path

import httpx
import pytest

from charlie.devbox import DevboxClient, DevboxError
from tests.devbox.conftest import TOKEN, ServerFactory, ServerProcess


def credential(token: str, workspace_id: str) -> str:
    """The credential as the devbox documents it, computed here independently."""
    key = hmac.new(token.encode(), b"charlie devbox workspace credential v1", hashlib.sha256)
    mac = hmac.new(key.digest(), workspace_id.encode(), hashlib.sha256).hexdigest()
    return f"cw1:{workspace_id}:{mac}"


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "README").write_text("hello\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "first"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=path,
            check=True,
            capture_output=True,
        )
    return path


def status_of(url: str, bearer: str, method: str, path: str, **kwargs: object) -> int:
    response = httpx.request(
        method, url + path, headers={"Authorization": f"Bearer {bearer}"}, **kwargs
    )
    return response.status_code


def test_a_workspace_credential_opens_only_its_workspace(make_server: ServerFactory) -> None:
    server = make_server()
    with DevboxClient(server.url, TOKEN) as admin:
        admin.ensure_workspace("ws-a", None)
        admin.ensure_workspace("ws-b", None)
        admin.write_file("ws-b", "secret.txt", "b's secret")
        b_command = admin.start_command("ws-b", shell="echo b").execution_id
    a = credential(TOKEN, "ws-a")
    # its own workspace: every operation works, its own commands too
    with DevboxClient(server.url, a) as own:
        assert own.ensure_workspace("ws-a", None).workspace_id == "ws-a"
        own.write_file("ws-a", "mine.txt", "a")
        assert own.read_file("ws-a", "mine.txt").content == "a"
        started = own.start_command("ws-a", shell="echo a")
        assert own.wait_command(started.execution_id, timeout=30).succeeded
        assert own.health()
    # another workspace's routes and commands: 403, and nothing is read, written or created
    refused = [
        ("GET", "/workspaces/ws-b", {}),
        ("PUT", "/workspaces/ws-b", {"json": {"repo": None}}),
        ("PUT", "/workspaces/ws-c", {"json": {"repo": None}}),
        ("GET", "/workspaces/ws-b/files?path=secret.txt", {}),
        ("PUT", "/workspaces/ws-b/files?path=x.txt", {"json": {"content": "planted"}}),
        ("GET", "/workspaces/ws-b/list", {}),
        ("POST", "/workspaces/ws-b/commands", {"json": {"shell": "touch pwned"}}),
        ("GET", "/workspaces/ws-b/diff", {}),
        ("POST", "/workspaces/ws-b/commit", {"json": {"message": "m", "idempotency_key": "k"}}),
        ("GET", f"/commands/{b_command}", {}),
        ("POST", f"/commands/{b_command}/cancel", {}),
    ]
    for method, path, kwargs in refused:
        assert status_of(server.url, a, method, path, **kwargs) == 403, (method, path)
    with DevboxClient(server.url, a) as own, pytest.raises(DevboxError) as info:
        own.read_file("ws-b", "secret.txt")
    assert info.value.status == 403 and "ws-a" in info.value.message
    ws_b = server.root / "workspaces" / "ws-b"
    assert not (ws_b / "x.txt").exists() and not (ws_b / "pwned").exists()
    assert not (server.root / "workspaces" / "ws-c").exists()
    # a forged or foreign credential is no credential at all
    for bad in (
        "cw1:ws-b:" + "0" * 64,
        credential("another-devbox-token", "ws-b"),
        a.replace("ws-a", "ws-b"),
    ):
        assert status_of(server.url, bad, "GET", "/workspaces/ws-b") == 401
    # the operator token still opens everything
    with DevboxClient(server.url, TOKEN) as admin:
        assert admin.read_file("ws-b", "secret.txt").content == "b's secret"
        assert admin.read_file("ws-a", "mine.txt").content == "a"


def test_repositories_come_only_from_allowed_sources(
    spawn_server, tmp_path: Path, devbox_root: Path
) -> None:
    """``charlie devbox serve --allow-repo``: the allowed root clones and copies; a path
    outside it, a URL no pattern matches, a ``..`` escape and the devbox's own root are 403s."""
    allowed = tmp_path / "allowed"
    good = make_repo(allowed / "good")
    elsewhere = make_repo(tmp_path / "elsewhere" / "repo")
    proc: ServerProcess = spawn_server(
        "--no-sandbox", "--allow-repo", str(allowed), "--allow-repo", "https://127.0.0.1:1/acme/*"
    )
    with DevboxClient(proc.url, TOKEN) as client:
        ws = client.ensure_workspace("good", str(good))
        assert ws.head is not None
        assert client.ensure_workspace("copy", copy_from=str(good)).head is not None
        refusals = {
            "outside": lambda: client.ensure_workspace("w1", str(elsewhere)),
            "dotdot": lambda: client.ensure_workspace("w2", f"{allowed}/../elsewhere/repo"),
            "copy_outside": lambda: client.ensure_workspace("w3", copy_from=str(elsewhere)),
            "file_url": lambda: client.ensure_workspace("w4", f"file://{elsewhere}"),
            "url": lambda: client.ensure_workspace("w5", "https://127.0.0.1:1/other/x.git"),
            "url_dotdot": lambda: client.ensure_workspace(
                "w6", "https://127.0.0.1:1/acme/../other/x.git"
            ),
            "own_root": lambda: client.ensure_workspace(
                "w7", copy_from=str(devbox_root / "workspaces" / "good")
            ),
            "system": lambda: client.ensure_workspace("w8", copy_from="/etc"),
        }
        for name, attempt in refusals.items():
            with pytest.raises(DevboxError) as info:
                attempt()
            assert info.value.status == 403, (name, info.value)
            assert "not allowed" in info.value.message, name
        assert "--allow-repo" in info.value.message
        # a URL that matches the pattern passes the policy (and then fails to clone: no such
        # host), so the refusal above was the policy's
        with pytest.raises(DevboxError) as info:
            client.ensure_workspace("w9", "https://127.0.0.1:1/acme/x.git")
        assert info.value.status != 403
        names = sorted(p.name for p in (devbox_root / "workspaces").iterdir())
        assert names == ["copy", "good"]


def test_by_default_no_repository_is_allowed(spawn_server, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    proc: ServerProcess = spawn_server("--no-sandbox")
    with DevboxClient(proc.url, TOKEN) as client:
        assert client.ensure_workspace("empty", None).head is not None
        for attempt in (
            lambda: client.ensure_workspace("r", str(repo)),
            lambda: client.ensure_workspace("c", copy_from=str(repo)),
        ):
            with pytest.raises(DevboxError) as info:
                attempt()
            assert info.value.status == 403
            assert "allowed: none" in info.value.message


@pytest.mark.parametrize(
    "plant",
    [
        "ln -sf {other}/.git/charlie-workspace.json .git/charlie-workspace.json",
        "mv .git .real && ln -s {other}/.git .git",
    ],
    ids=["spec-symlink", "git-dir-symlink"],
)
def test_a_planted_symlink_shows_nothing_of_another_workspaces_spec(
    make_server: ServerFactory, tmp_path: Path, plant: str
) -> None:
    # b's repository (its URL could carry credentials) is b's alone; a command in a links a's
    # spec to b's, then a's worker asks for a's workspace with another spec: the conflict's
    # message must not show b's
    repo = make_repo(tmp_path / "b-private-repo")
    server = make_server()
    with DevboxClient(server.url, TOKEN) as admin:
        admin.ensure_workspace("ws-a", None)
        other = Path(admin.ensure_workspace("ws-b", str(repo)).path)
        started = admin.start_command("ws-a", shell=plant.format(other=other))
        assert admin.wait_command(started.execution_id, timeout=30).succeeded
        with pytest.raises(DevboxError) as info:
            admin.ensure_workspace("ws-a", None, branch="elsewhere")
    assert info.value.status in (404, 409), info.value
    assert "b-private-repo" not in info.value.message
