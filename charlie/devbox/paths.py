"""Path safety: every path a request names is resolved and must stay inside its workspace.

A caller (ultimately a model) chooses these paths, so ``..``, absolute paths and symlinks that
point outside are refused before any file is opened. The check resolves symlinks with
``os.path.realpath`` and compares prefixes; a command running in the workspace could still swap
a symlink in between check and use, which is acceptable because commands already run as the
devbox's user (see ``policy``): the check protects against mistakes, not against commands.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path, PurePosixPath

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


def resolve_inside(workspace: Path, rel: str, *, allow_root: bool = False) -> Path:
    """The real path ``rel`` names inside ``workspace``, or 400 naming the path.

    Refuses absolute paths and ``..`` outright (even when they would land inside: the caller is
    meant to speak in workspace-relative paths), then resolves symlinks and refuses a result
    outside the workspace, which also refuses writing through a symlink that escapes.
    """
    if not isinstance(rel, str) or rel == "" or "\x00" in rel:
        raise ApiError(
            400, f"invalid path {rel!r}: give a non-empty path relative to the workspace"
        )
    if os.path.isabs(rel) or rel.startswith("~"):
        raise ApiError(400, f"path {rel!r} is absolute; give a path relative to the workspace")
    if ".." in PurePosixPath(rel).parts:
        raise ApiError(400, f"path {rel!r} contains '..'; paths must stay inside the workspace")
    base = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(base, rel))
    if target == base:
        if allow_root:
            return Path(target)
        raise ApiError(400, f"path {rel!r} names the workspace itself, not a file in it")
    if not target.startswith(base + os.sep):
        raise ApiError(400, f"path {rel!r} resolves outside the workspace (through a symlink)")
    return Path(target)


def relative_parts(workspace: Path, target: Path) -> tuple[str, ...]:
    """The components of ``target`` relative to the workspace's real path."""
    return Path(target).relative_to(os.path.realpath(workspace)).parts


def tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` take (symlinks not followed), for the workspace disk cap."""
    total = 0
    stack = [str(root)]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue  # vanished or unreadable: a concurrent command may be deleting it
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total
