"""charlie/beneath.py: paths beneath a directory, opened by descriptor (I33), by openat2 and by
the component walk alike (the walk forced here, as on a kernel without openat2), and the tool
SDK's openers built on it."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from charlie import beneath
from charlie.beneath import Outside, Root
from charlie.tools.context import ToolContext, WorkspaceEscape

pytestmark = pytest.mark.backend_free


@pytest.fixture(params=["openat2", "walk"])
def way(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "openat2" and not beneath.openat2_available():
        pytest.skip("this kernel has no openat2")
    beneath.force_walk(request.param == "walk")
    try:
        yield request.param
    finally:
        beneath.force_walk(False)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """ws/a/f (a file), links inside (al -> a, fl -> a/f, chain -> fl), links that leave
    (up -> ../secret, abs -> the secret's absolute path, proc -> /proc/self, updir -> ..),
    a loop, and a secret beside ws."""
    ws = tmp_path / "ws"
    (ws / "a").mkdir(parents=True)
    (ws / "a" / "f").write_text("inside")
    (tmp_path / "secret").write_text("secret")
    for name, target in [
        ("al", "a"),
        ("fl", "a/f"),
        ("chain", "fl"),
        ("up", "../secret"),
        ("abs", str(tmp_path / "secret")),
        ("proc", "/proc/self"),
        ("updir", ".."),
        ("loop", "loop"),
        ("dot", "."),
    ]:
        (ws / name).symlink_to(target)
    (ws / "a" / "back").symlink_to("../fl")
    return ws


def _read(root: Root, rel: str, flags: int = os.O_RDONLY) -> str:
    fd = root.open(rel, flags)
    try:
        return os.read(fd, 100).decode()
    finally:
        os.close(fd)


def test_opens_follow_links_that_stay_beneath(way: str, tree: Path) -> None:
    with Root(tree) as root:
        for rel in ("a/f", "al/f", "fl", "chain", "a/back", "a/../a/f", "al/../al/f", "dot/a/f"):
            assert _read(root, rel) == "inside", rel
        top, a = root.opendir("dot"), root.opendir("a")
        assert root.is_root(top) and not root.is_root(a)
        os.close(top)
        os.close(a)


@pytest.mark.parametrize(
    "rel",
    ["up", "abs", "proc/environ", "updir/secret", "../secret", "a/../../secret", "/etc/passwd"],
)
def test_what_leaves_is_refused(way: str, tree: Path, rel: str) -> None:
    with Root(tree) as root, pytest.raises(Outside, match="outside the workspace"):
        os.close(root.open(rel, os.O_RDONLY))


def test_final_link_not_followed_with_nofollow_and_loops_end(way: str, tree: Path) -> None:
    with Root(tree) as root:
        with pytest.raises(OSError) as caught:
            root.open("fl", os.O_RDONLY | os.O_NOFOLLOW)
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(OSError) as caught:
            root.open("loop", os.O_RDONLY)
        assert caught.value.errno == errno.ELOOP
        with pytest.raises(FileNotFoundError):
            root.open("a/missing", os.O_RDONLY)
        with pytest.raises(NotADirectoryError):
            root.open("a/f/x", os.O_RDONLY)
        with pytest.raises(ValueError, match="NUL"):
            root.open("a\x00b", os.O_RDONLY)


def test_write_atomic_makes_directories_and_writes_through_links_beneath(
    way: str, tree: Path
) -> None:
    with Root(tree) as root:
        root.write_atomic("new/deep/x.txt", b"made")
        assert (tree / "new" / "deep" / "x.txt").read_text() == "made"
        root.write_atomic("chain", b"through the chain")
        assert (tree / "a" / "f").read_text() == "through the chain"
        assert (tree / "chain").is_symlink() and (tree / "fl").is_symlink()
        root.write_atomic("al/g", b"via a dir link")
        assert (tree / "a" / "g").read_text() == "via a dir link"
        for rel in ("up", "abs", "updir/x", "proc/x", "../x"):
            with pytest.raises(Outside):
                root.write_atomic(rel, b"escape")
        with pytest.raises(IsADirectoryError):
            root.write_atomic("a", b"over a directory")
        with pytest.raises(IsADirectoryError):
            root.write_atomic(".", b"the root")
    assert (tree.parent / "secret").read_text() == "secret"
    assert sorted(os.listdir(tree.parent)) == ["secret", "ws"]
    assert not [n for n in os.listdir(tree / "a") if n.endswith(".charlie-tmp")]


def test_write_atomic_keeps_the_old_mode_when_asked(way: str, tree: Path) -> None:
    (tree / "a" / "f").chmod(0o600)
    with Root(tree) as root:
        root.write_atomic("a/f", b"kept", keep_mode=True)
    assert stat.S_IMODE((tree / "a" / "f").stat().st_mode) == 0o600


def test_reading_and_counting(way: str, tree: Path) -> None:
    os.mkfifo(tree / "fifo")
    with Root(tree) as root:
        assert root.read_head("a/f", 3) == (b"insi", 6)
        with pytest.raises(OSError) as caught:
            root.read_head("fifo", 10)  # refused, not waited on
        assert caught.value.errno == errno.EINVAL
        with pytest.raises(IsADirectoryError):
            root.read_head("a", 10)
        with root.scandir("al") as entries:
            assert sorted(e.name for e in entries) == ["back", "f"]
        with pytest.raises(Outside):
            root.scandir("updir").__enter__()
        # the links' own sizes and the file's; nothing of what a link leads to outside
        links = sum(os.lstat(p).st_size for p in tree.iterdir() if p.is_symlink())
        links += os.lstat(tree / "a" / "back").st_size
        assert root.tree_bytes() == 6 + links


def test_the_probe_and_the_switch() -> None:
    beneath.force_walk(True)
    try:
        assert not beneath.openat2_available()
    finally:
        beneath.force_walk(False)
    major, minor = (int(n) for n in os.uname().release.split(".")[:2])
    if (major, minor) >= (5, 6):
        # (a seccomp filter may still refuse it: then the walk, and this says so)
        assert beneath.openat2_available(), "openat2 refused on a 5.6+ kernel"


# -- the tool SDK's openers ----------------------------------------------------------------


def _ctx(ws: Path) -> ToolContext:
    return ToolContext("t", "x-t", "c", 0, ws, {}, False, None, lambda _h: None)


def test_ctx_openers(way: str, tree: Path) -> None:
    ctx = _ctx(tree)
    assert ctx.read_text("al/f") == "inside"
    assert ctx.read_text(str(tree / "a" / "f")) == "inside"  # absolute, inside: taken
    ctx.write_text("notes/today.md", "written")
    assert (tree / "notes" / "today.md").read_text() == "written"
    with ctx.open("notes/today.md", "a") as f:
        f.write(", appended")
    with ctx.open("notes/today.md", "rb") as f:
        assert f.read() == b"written, appended"
    with ctx.open("notes/new.txt", "x") as f:
        f.write("exclusive")
    with pytest.raises(FileExistsError):
        ctx.open("notes/new.txt", "x")
    assert ctx.listdir("notes") == ["new.txt", "today.md"]
    assert "a" in ctx.listdir()
    os.mkfifo(tree / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        ctx.open("fifo")
    with pytest.raises(IsADirectoryError):
        ctx.open("a")
    with pytest.raises(ValueError, match="invalid mode"):
        ctx.open("a/f", "rw")
    for bad in ("up", "abs", "proc/environ", "../secret", "/etc/passwd", "updir/secret"):
        with pytest.raises(WorkspaceEscape, match="outside the task's workspace"):
            ctx.read_text(bad)
        with pytest.raises(WorkspaceEscape):
            ctx.write_text(bad, "x")
    with pytest.raises(WorkspaceEscape):
        ctx.listdir("updir")
    assert (tree.parent / "secret").read_text() == "secret"
