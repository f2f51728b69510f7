"""Workspaces: git checkouts under ``root/workspaces/<id>`` and the file and git operations on
them.

A workspace is built in a scratch directory and renamed into place, so a devbox killed
mid-clone leaves no half workspace under the id. The spec it was created from is kept in its
``.git`` directory (inside the same rename), which makes ``ensure`` idempotent: the same spec
returns the existing workspace, a different one is a conflict.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from contextlib import suppress
from pathlib import Path, PurePosixPath
from typing import Any

from charlie.beneath import Outside, Root
from charlie.devbox import git
from charlie.devbox.confinement import git_policy
from charlie.devbox.errors import ApiError
from charlie.devbox.paths import check_relative, check_workspace_id, outside
from charlie.devbox.policy import Limits, RepoPolicy, is_url
from charlie.sandbox import SandboxPolicy

_SPEC_FILE = "charlie-workspace.json"


class Workspaces:
    def __init__(self, root: Path, limits: Limits, repos: RepoPolicy | None = None) -> None:
        self.root = root
        self.repos = repos or RepoPolicy()
        self.dir = root / "workspaces"
        self.scratch = root / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def lock(self, workspace_id: str) -> threading.Lock:
        """One lock per workspace: creation, writes, patches and commits do not interleave."""
        with self._locks_guard:
            return self._locks.setdefault(workspace_id, threading.Lock())

    def confine(self, workspace: Path) -> SandboxPolicy | None:
        """Where the devbox's git on ``workspace`` runs: in its commands' confinement, since a
        command can change what that git reads at any moment (see ``git``)."""
        return git_policy(self.root, self.limits, workspace)

    def path(self, workspace_id: str) -> Path:
        """The existing workspace's directory, or 404."""
        path = self.dir / check_workspace_id(workspace_id)
        if not (path / ".git").is_dir():
            raise ApiError(404, f"no workspace {workspace_id!r}")
        return path

    # -- create and describe -------------------------------------------------------------------

    def ensure(self, workspace_id: str, body: dict[str, Any]) -> dict[str, Any]:
        spec = _spec(body)
        check_workspace_id(workspace_id)
        self._check_source(spec)
        with self.lock(workspace_id):
            target = self.dir / workspace_id
            if (target / ".git").is_dir():
                existing = _read_spec(target)
                if existing != spec:
                    raise ApiError(
                        409,
                        f"workspace {workspace_id!r} exists with a different spec "
                        f"({json.dumps(existing, sort_keys=True)})",
                    )
                return {**self.describe(workspace_id), "created": False}
            build = Path(tempfile.mkdtemp(prefix=f"ws-{workspace_id}-", dir=self.scratch))
            try:
                self._build(build / "w", spec)
                (build / "w" / ".git" / _SPEC_FILE).write_text(json.dumps(spec, sort_keys=True))
                os.replace(build / "w", target)
            finally:
                shutil.rmtree(build, ignore_errors=True)
        # ``created`` tells a caller the workspace was (re)built just now: after the devbox lost
        # a workspace, what was changed in it before is gone.
        return {**self.describe(workspace_id), "created": True}

    def _check_source(self, spec: dict[str, Any]) -> None:
        """Only sources the operator allows (403 otherwise), and never the
        devbox's own root, where the other workspaces and the commands' records are. Checked
        on every ensure, so a source the operator no longer allows is refused for an existing
        workspace too."""
        for key, check in (
            ("repo", self.repos.check_repo),
            ("copy_from", self.repos.check_copy_from),
        ):
            source = spec.get(key)
            if source is None:
                continue
            if not is_url(source):
                real = os.path.realpath(source)
                root = os.path.realpath(self.root)
                if real == root or real.startswith(root + os.sep):
                    raise ApiError(
                        403, f"{key} {source!r} is inside the devbox's own root; not allowed"
                    )
            check(source)

    def describe(self, workspace_id: str) -> dict[str, Any]:
        path = self.path(workspace_id)
        t, confine = self.limits.git_timeout, self.confine(path)
        return {
            "workspace_id": workspace_id,
            "path": str(path),
            "head": git.head(path, t, confine=confine),
            "branch": git.current_branch(path, t, confine=confine),
        }

    # Building happens in the scratch directory, which no command can see, on a repository git
    # has just made: its git runs unconfined (``confine=None``), with the network and the
    # operator's credentials a clone needs.

    def _build(self, dest: Path, spec: dict[str, Any]) -> None:
        t = self.limits.git_timeout
        if spec.get("copy_from") is not None:
            self._build_copy(dest, spec)
        elif spec["repo"] is None:
            dest.mkdir()
            init = ["init", "-q", "-b", spec["branch"] or "main"]
            git.run_git(init, dest, timeout=t, confine=None)
            # an initial commit gives HEAD a value, so diff and commit behave as on a clone
            git.run_git(
                ["commit", "-q", "--allow-empty", "-m", "Empty workspace"],
                dest,
                timeout=t,
                confine=None,
            )
        else:
            git.run_git(
                ["clone", "-q", "--", spec["repo"], str(dest)],
                self.scratch,
                timeout=t,
                confine=None,
                status_on_error=422,
            )
        self._checkout(dest, spec)

    def _build_copy(self, dest: Path, spec: dict[str, Any]) -> None:
        source = Path(spec["copy_from"])
        if not source.is_dir():
            raise ApiError(422, f"copy_from {str(source)!r} is not a directory on the devbox")
        t = self.limits.git_timeout
        shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        git.run_git(["init", "-q", "-b", spec["branch"] or "main"], dest, timeout=t, confine=None)
        git.run_git(["add", "-A"], dest, timeout=t, confine=None)
        git.run_git(
            ["commit", "-q", "--allow-empty", "-m", f"Copy of {source.name}"],
            dest,
            timeout=t,
            confine=None,
        )

    def _checkout(self, dest: Path, spec: dict[str, Any]) -> None:
        """Put the clone on the requested branch and/or base commit."""
        t = self.limits.git_timeout
        branch: str | None = spec.get("branch")
        base: str | None = spec.get("base_commit")
        if base is not None:
            git.run_git(
                ["rev-parse", "--verify", "-q", f"{base}^{{commit}}"],
                dest,
                timeout=t,
                confine=None,
                status_on_error=422,
            )
        if branch is None and base is None:
            return
        if branch is None:
            assert base is not None
            git.run_git(
                ["checkout", "-q", "--detach", base],
                dest,
                timeout=t,
                confine=None,
                status_on_error=422,
            )
            return
        start = base
        if start is None:
            remote = f"refs/remotes/origin/{branch}"
            has_remote = git.run_git(
                ["rev-parse", "--verify", "-q", remote], dest, timeout=t, confine=None, check=False
            )
            start = remote if has_remote.returncode == 0 else None
        args = ["checkout", "-q", "-B", branch] + ([start] if start else [])
        git.run_git(args, dest, timeout=t, confine=None, status_on_error=422)

    # -- files ---------------------------------------------------------------------------------

    # Every file operation opens its path beneath the workspace's directory descriptor, at the
    # moment of the open (charlie/beneath.py): a command in the workspace may exchange a
    # directory with a symlink at any moment (I33).

    def read_file(self, workspace_id: str, rel: str) -> dict[str, Any]:
        check_relative(rel)
        limit = self.limits.read_bytes
        try:
            # Not followed out of the workspace, not waited on if it is a FIFO, and read no
            # further than the limit: a command may be growing it right now.
            with Root(self.path(workspace_id)) as root:
                data, size = root.read_head(rel, limit)
        except Outside:
            raise outside(rel) from None
        except (FileNotFoundError, NotADirectoryError):
            raise ApiError(404, f"no file {rel!r} in workspace {workspace_id!r}") from None
        except IsADirectoryError:
            raise ApiError(400, f"{rel!r} is not a regular file") from None
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise ApiError(400, f"{rel!r} is not a regular file") from None
            raise ApiError(400, f"cannot read {rel!r}: {exc.strerror}") from None
        if size > limit:
            raise ApiError(
                413,
                f"{rel!r} is {size} bytes, over the devbox read limit of "
                f"{limit} bytes; read part of it with a command instead",
            )
        try:
            content, binary = data.decode("utf-8"), False
        except UnicodeDecodeError:
            content, binary = data.decode("utf-8", errors="replace"), True
        return {"path": rel, "content": content, "size": size, "binary": binary}

    def write_file(self, workspace_id: str, rel: str, content: str) -> dict[str, Any]:
        check_relative(rel)
        workspace = self.path(workspace_id)
        data = content.encode("utf-8")
        with self.lock(workspace_id), Root(workspace) as root:
            try:
                self._write(root, workspace_id, rel, data)
            except Outside:
                raise outside(rel) from None
            except OSError as exc:
                raise ApiError(400, f"cannot write {rel!r}: {exc.strerror}") from None
        return {"path": rel, "size": len(data)}

    def _write(self, root: Root, workspace_id: str, rel: str, data: bytes) -> None:
        real = root.final(rel)  # a symlink at rel is written through, if it stays inside
        if PurePosixPath(real).parts[:1] == (".git",):
            raise ApiError(400, f"path {rel!r} is inside .git; the devbox does not write there")
        try:
            dir_fd, name = root.parent(real)
        except FileNotFoundError:
            dir_fd, name = -1, ""  # its directories are made below, once the room is checked
        try:
            old = 0
            if dir_fd >= 0:
                _refuse_git(root, dir_fd, rel)
                with suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        raise ApiError(400, f"{rel!r} is a directory")
                    old = st.st_size if stat.S_ISREG(st.st_mode) else 0
            self._check_room(root, workspace_id, len(data) - old)
            if dir_fd < 0:
                dir_fd, name = root.parent(real, create=True)
                _refuse_git(root, dir_fd, rel)
            try:
                Root.write_in(dir_fd, name, data, keep_mode=True)
            except IsADirectoryError:
                raise ApiError(400, f"{rel!r} is a directory") from None
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)

    def _check_room(self, root: Root, workspace_id: str, growth: int) -> None:
        used = root.tree_bytes()
        if growth > 0 and used + growth > self.limits.workspace_bytes:
            raise ApiError(
                413,
                f"workspace {workspace_id!r} would grow to {used + growth} bytes, over its "
                f"disk limit of {self.limits.workspace_bytes} bytes",
            )

    def list_files(self, workspace_id: str, rel: str) -> dict[str, Any]:
        rel = rel or "."
        check_relative(rel, allow_root=True)
        limit = self.limits.list_entries
        entries: list[dict[str, Any]] = []
        truncated = False
        with Root(self.path(workspace_id)) as root:
            try:
                fd = root.opendir(rel)
            except Outside:
                raise outside(rel) from None
            except FileNotFoundError:
                raise ApiError(404, f"{rel!r} is not a directory") from None
            except OSError:
                raise ApiError(400, f"{rel!r} is not a directory") from None
            try:
                at_root = root.is_root(fd)
                # each entry described from the directory's descriptor, while it is open; at
                # most the limit of it read: a command can put millions of entries in one
                with os.scandir(fd) as scan:
                    for entry in scan:
                        if at_root and entry.name == ".git":
                            continue  # git's own data, not the agent's files
                        if len(entries) == limit:
                            truncated = True
                            break
                        entries.append(_entry(entry))
            finally:
                os.close(fd)
        entries.sort(key=lambda e: str(e["name"]))
        return {"path": rel, "entries": entries, "truncated": truncated}

    # -- git operations ------------------------------------------------------------------------

    def apply_patch(self, workspace_id: str, diff: str) -> dict[str, Any]:
        workspace = self.path(workspace_id)
        t, confine = self.limits.git_timeout, self.confine(workspace)
        if not diff.strip():
            raise ApiError(400, "the patch is empty")
        with self.lock(workspace_id), Root(workspace) as root:
            self._check_room(root, workspace_id, len(diff.encode("utf-8")))
            numstat = git.run_git(
                ["apply", "--numstat", "-"],
                workspace,
                timeout=t,
                confine=confine,
                input_text=diff,
                check=False,
            )
            if numstat.returncode != 0:
                raise ApiError(422, f"patch is not a valid diff: {numstat.stderr.strip()}")
            done = git.run_git(
                ["apply", "--whitespace=nowarn", "-"],
                workspace,
                timeout=t,
                confine=confine,
                input_text=diff,
                check=False,
            )
            if done.returncode != 0:
                raise ApiError(422, f"patch does not apply: {done.stderr.strip()}")
        files = [line.split("\t", 2)[2] for line in numstat.stdout.splitlines() if "\t" in line]
        return {"applied": True, "files": files}

    def diff(self, workspace_id: str) -> dict[str, Any]:
        workspace = self.path(workspace_id)
        t, confine = self.limits.git_timeout, self.confine(workspace)
        base = "HEAD" if git.head(workspace, t, confine=confine) else git.EMPTY_TREE
        limit = self.limits.output_bytes
        # read no more of either than is returned: their size is the workspace's
        done = git.run_git(
            ["diff", "--no-ext-diff", "--no-textconv", "--no-color", base],
            workspace,
            timeout=t,
            confine=confine,
            max_output=limit + 4,  # (a cut character's bytes, then one more: there is more)
        )
        untracked = git.run_git(
            ["ls-files", "--others", "--exclude-standard", "-z"],
            workspace,
            timeout=t,
            confine=confine,
            max_output=limit,
        )
        text, truncated = done.stdout, False
        if done.truncated or len(text.encode("utf-8")) > limit:
            text = text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
            text += f"\n[diff truncated at {limit} bytes]\n"
            truncated = True
        names = [name for name in untracked.stdout.split("\x00") if name]
        if untracked.truncated:
            names = names[:-1]  # (the last one may be cut)
            truncated = True
        return {"diff": text, "untracked": names, "truncated": truncated}

    def commit(self, workspace_id: str, message: str, key: str) -> dict[str, Any]:
        """Commit everything with the key as a trailer, once: a retry finds the first commit.

        ``--allow-empty`` so a commit is recorded (and findable by key) even when the tree did
        not change, which keeps "did my commit happen?" a yes/no question for reconcile.
        """
        workspace = self.path(workspace_id)
        t, confine = self.limits.git_timeout, self.confine(workspace)
        with self.lock(workspace_id):
            existing = git.find_commit(workspace, key, t, confine=confine)
            if existing is not None:
                return {"commit": existing, "created": False}
            if self._seal(workspace_id, key).exists():
                raise ApiError(
                    409,
                    "not committed: a reconcile found no commit with this idempotency key and "
                    "sealed it, so this late attempt must not commit (the call settled as not "
                    "committed); commit again as a new call",
                )
            git.run_git(["add", "-A"], workspace, timeout=t, confine=confine)
            git.run_git(
                ["commit", "-q", "--no-verify", "--allow-empty", "-F", "-"],
                workspace,
                timeout=t,
                confine=confine,
                input_text=git.commit_message(message, key),
            )
            sha = git.head(workspace, t, confine=confine)
        return {"commit": sha, "created": True}

    def find_commit(self, workspace_id: str, key: str, *, seal: bool = False) -> dict[str, Any]:
        """The commit carrying ``key``, under the workspace's lock: a reconcile asking while a
        commit with that key is being made waits for it, so it never answers "not committed"
        in the middle of one. With ``seal``, a key not found is sealed: a
        paused holder's late commit with it is refused, so the answer stays true (I10)."""
        workspace = self.path(workspace_id)
        with self.lock(workspace_id):
            found = git.find_commit(
                workspace, key, self.limits.git_timeout, confine=self.confine(workspace)
            )
            if found is None and seal:
                path = self._seal(workspace_id, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            return {"commit": found}

    def _seal(self, workspace_id: str, key: str) -> Path:
        """Where a sealed commit key is marked: in the devbox root, out of commands' reach."""
        digest = hashlib.sha256(f"{workspace_id}\0{key}".encode()).hexdigest()
        return self.root / "commit-seals" / digest


def _spec(body: dict[str, Any]) -> dict[str, Any]:
    """The normalized creation spec; what idempotent re-creation compares."""
    if "repo" not in body and "copy_from" not in body:
        raise ApiError(
            400,
            "give 'repo' (a path or URL, or null for an empty workspace) or "
            "'copy_from' (a directory on the devbox)",
        )
    spec: dict[str, Any] = {}
    for key in ("repo", "copy_from", "branch", "base_commit"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
            raise ApiError(400, f"{key!r} must be a non-empty string or null")
        spec[key] = value
    if spec["repo"] is not None and spec["copy_from"] is not None:
        raise ApiError(400, "give either 'repo' or 'copy_from', not both")
    if spec["repo"] is not None and spec["repo"].startswith("-"):
        raise ApiError(400, f"repo {spec['repo']!r} may not start with '-'")
    if spec["copy_from"] is not None:
        spec["copy_from"] = os.path.realpath(spec["copy_from"])
    if spec["repo"] is None and spec["copy_from"] is None and spec["base_commit"] is not None:
        raise ApiError(400, "'base_commit' needs a 'repo' to take it from")
    return spec


def _read_spec(path: Path) -> dict[str, Any] | None:
    """The spec the workspace was made from, or None. Neither ``.git`` nor the file is followed
    through a symlink: a command can plant one pointing at another workspace's spec (its
    repository URL may carry credentials), which a conflict's message would then show. Only a
    regular file is read (a FIFO there would block the devbox)."""
    try:
        git_dir = os.open(path / ".git", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(_SPEC_FILE, flags, dir_fd=git_dir)
        finally:
            os.close(git_dir)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = json.loads(f.read(64 * 1024))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _refuse_git(root: Root, dir_fd: int, rel: str) -> None:
    """400 when the directory open at ``dir_fd`` is the workspace's ``.git`` or beneath it:
    asked of the directory that was opened (its parents by ``..``, which follows no link), so
    a directory swapped for a link to ``.git`` is seen."""
    try:
        git_dir = os.stat(".git", dir_fd=root.fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    top = os.fstat(root.fd)
    current = os.dup(dir_fd)
    try:
        for _ in range(4096):
            st = os.fstat(current)
            here = (st.st_dev, st.st_ino)
            if here == (git_dir.st_dev, git_dir.st_ino):
                raise ApiError(400, f"path {rel!r} is inside .git; the devbox does not write there")
            if here == (top.st_dev, top.st_ino):
                return
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
            if os.fstat(up).st_ino == st.st_ino and os.fstat(up).st_dev == st.st_dev:
                os.close(up)
                return  # the filesystem's top: not beneath .git
            os.close(current)
            current = up
    finally:
        os.close(current)


def _entry(entry: os.DirEntry[str]) -> dict[str, Any]:
    if entry.is_symlink():
        kind = "symlink"
    elif entry.is_dir(follow_symlinks=False):
        kind = "dir"
    elif entry.is_file(follow_symlinks=False):
        kind = "file"
    else:
        kind = "other"
    try:
        size = entry.stat(follow_symlinks=False).st_size if kind == "file" else None
    except OSError:
        size = None
    return {"name": entry.name, "type": kind, "size": size}
