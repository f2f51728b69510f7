"""Path safety: every path a request names must stay inside its workspace.

A caller (ultimately a model) chooses these paths, so ``..`` and absolute paths are refused
outright (``check_relative``); symlinks that point outside are refused where the path is
opened, beneath the workspace's directory descriptor (charlie/beneath.py), at the moment of the
open: a command running in the workspace may swap a directory for a symlink at any moment
(I33).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path, PurePosixPath

from charlie.beneath import Root
from charlie.devbox.errors import ApiError

_WORKSPACE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_workspace_id(workspace_id: str) -> str:
    """A workspace id is a single safe path segment, since it names a directory under root."""
    if not _WORKSPACE_ID.fullmatch(workspace_id) or ".." in workspace_id:
        raise ApiError(
            400,
            f"invalid workspace id {workspace_id!r}: use 1-128 letters, digits, '.', '_' or '-'",
        )
    return workspace_id


def check_execution_id(execution_id: str) -> str:
    """Execution ids are uuids; anything else cannot name a command (and cannot escape root)."""
    try:
        canonical = str(uuid.UUID(execution_id))
    except ValueError:
        raise ApiError(404, f"no command with execution id {execution_id!r}") from None
    if canonical != execution_id:
        raise ApiError(404, f"no command with execution id {execution_id!r}")
    return execution_id


def check_relative(rel: str, *, allow_root: bool = False) -> str:
    """``rel`` as a path relative to the workspace, or 400 naming it.

    Refuses absolute paths and ``..`` outright (even when they would land inside: the caller is
    meant to speak in workspace-relative paths). Where it leads is decided where it is opened,
    beneath the workspace's descriptor (charlie/beneath.py, I33), not here.
    """
    if not isinstance(rel, str) or rel == "" or "\x00" in rel:
        raise ApiError(
            400, f"invalid path {rel!r}: give a non-empty path relative to the workspace"
        )
    if os.path.isabs(rel) or rel.startswith("~"):
        raise ApiError(400, f"path {rel!r} is absolute; give a path relative to the workspace")
    if ".." in PurePosixPath(rel).parts:
        raise ApiError(400, f"path {rel!r} contains '..'; paths must stay inside the workspace")
    if PurePosixPath(rel).parts in ((), (".",)) and not allow_root:
        raise ApiError(400, f"path {rel!r} names the workspace itself, not a file in it")
    return rel


def outside(rel: str) -> ApiError:
    """The refusal of a path that leads outside the workspace where it is opened."""
    return ApiError(400, f"path {rel!r} resolves outside the workspace (through a symlink)")


def resolve_inside(workspace: Path, rel: str, *, allow_root: bool = False) -> Path:
    """The real path ``rel`` names inside ``workspace``, or 400 naming the path.

    A check, not a guarantee: it resolves symlinks now, and a command may swap one in before
    the path is used. Files are opened with charlie/beneath.py instead; this is for a path
    handed to the sandbox (a command's working directory), which confines what it reaches.
    """
    check_relative(rel, allow_root=allow_root)
    base = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(base, rel))
    if target == base:
        if allow_root:
            return Path(target)
        raise ApiError(400, f"path {rel!r} names the workspace itself, not a file in it")
    if not target.startswith(base + os.sep):
        raise outside(rel)
    return Path(target)


def tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take (symlinks not followed), for the workspace disk cap;
    each directory opened beneath ``root`` by descriptor, so none swapped for a link is
    counted from outside."""
    try:
        with Root(root) as opened:
            return opened.tree_bytes()
    except OSError:
        return 0  # vanished
