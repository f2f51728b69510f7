"""Files in a workspace: reads and writes stay inside it, and the disk cap holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from charlie.devbox import DevboxClient, DevboxError, Limits

from .conftest import TOKEN, ServerFactory


def _refused(call: object, *args: object) -> DevboxError:
    with pytest.raises(DevboxError) as info:
        call(*args)  # type: ignore[operator]
    return info.value


def test_write_read_list(client: DevboxClient, workspace: str) -> None:
    assert client.write_file(workspace, "src/app.py", "print('hi')\n") == 12
    got = client.read_file(workspace, "src/app.py")
    assert (got.content, got.size, got.binary) == ("print('hi')\n", 12, False)
    client.write_file(workspace, "src/app.py", "print('bye')\n")  # overwrite
    assert client.read_file(workspace, "src/app.py").content == "print('bye')\n"
    top = {e.name: e for e in client.list_files(workspace)}
    assert set(top) == {"src"} and top["src"].type == "dir"  # .git is not listed
    inner = client.list_files(workspace, "src")
    assert [(e.name, e.type, e.size) for e in inner] == [("app.py", "file", 13)]


def test_missing_file_is_404(client: DevboxClient, workspace: str) -> None:
    assert _refused(client.read_file, workspace, "nope.txt").status == 404


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "~/x"])
def test_escaping_paths_refused(client: DevboxClient, workspace: str, path: str) -> None:
    for error in (
        _refused(client.read_file, workspace, path),
        _refused(client.write_file, workspace, path, "pwned"),
    ):
        assert error.status == 400
        assert repr(path) in error.message


def test_symlinks_pointing_outside_refused(
    client: DevboxClient, workspace: str, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    root = Path(client.get_workspace(workspace).path)
    os.symlink(outside / "secret.txt", root / "link.txt")
    os.symlink(outside, root / "linkdir")
    os.symlink(outside / "new.txt", root / "dangling.txt")
    for path in ("link.txt", "linkdir/secret.txt"):
        error = _refused(client.read_file, workspace, path)
        assert error.status == 400 and "outside the workspace" in error.message
    for path in ("link.txt", "linkdir/new.txt", "dangling.txt"):
        assert _refused(client.write_file, workspace, path, "pwned").status == 400
    assert _refused(client.list_files, workspace, "linkdir").status == 400
    assert (outside / "secret.txt").read_text() == "secret"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_symlink_inside_is_followed(client: DevboxClient, workspace: str) -> None:
    client.write_file(workspace, "real.txt", "inside")
    os.symlink("real.txt", Path(client.get_workspace(workspace).path) / "alias.txt")
    assert client.read_file(workspace, "alias.txt").content == "inside"


def test_git_dir_not_writable(client: DevboxClient, workspace: str) -> None:
    error = _refused(client.write_file, workspace, ".git/hooks/pre-commit", "#!/bin/sh\n")
    assert error.status == 400 and ".git" in error.message


def test_git_dir_not_writable_through_a_link(client: DevboxClient, workspace: str) -> None:
    """Asked of the directory that was opened, not of the path's spelling: a link to .git (or
    into it) is no way in, while a link to another directory inside is written through."""
    root = Path(client.get_workspace(workspace).path)
    os.symlink(".git", root / "g")
    os.symlink(".git/config", root / "c")
    for path in ("g/hooks/pre-commit", "g/config", "c"):
        error = _refused(client.write_file, workspace, path, "[core]\n")
        assert error.status == 400 and ".git" in error.message, path
    assert not (root / ".git" / "hooks" / "pre-commit").exists()
    (root / "sub").mkdir()
    os.symlink("sub", root / "alias")
    client.write_file(workspace, "alias/x.txt", "via a link inside")
    assert (root / "sub" / "x.txt").read_text() == "via a link inside"


def test_workspace_disk_cap(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(workspace_bytes=2 * 1024 * 1024))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        c.write_file("ws", "small.txt", "x" * 1000)
        error = _refused(c.write_file, "ws", "big.txt", "x" * (3 * 1024 * 1024))
        assert error.status == 413
        assert "disk limit" in error.message
        assert _refused(c.read_file, "ws", "big.txt").status == 404
        big_patch = (
            "--- /dev/null\n+++ b/big.txt\n@@ -0,0 +1 @@\n+" + "x" * (3 * 1024 * 1024) + "\n"
        )
        assert _refused(c.apply_patch, "ws", big_patch).status == 413
        # shrinking a file is always allowed
        c.write_file("ws", "small.txt", "")


def test_read_cap(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(read_bytes=100))
    with DevboxClient(server.url, TOKEN) as c:
        c.ensure_workspace("ws", None)
        c.write_file("ws", "big.txt", "y" * 101)
        error = _refused(c.read_file, "ws", "big.txt")
    assert error.status == 413 and "read limit" in error.message
