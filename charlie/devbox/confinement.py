"""What a workspace's programs may see: one bubblewrap view for its commands and for the
devbox's own git on it.

A command writes its workspace, ``.git`` included, so anything git reads there is the agent's
to steer, at any moment. The devbox's git therefore runs in the same confinement as the
workspace's commands (see ``git``): the workspace read-write, the devbox root (the other
workspaces, commands' records, commit seals) and Charlie's state hidden, no network, its own pid
namespace (no ``/proc`` of the devbox, whose environment holds the token).
"""

from __future__ import annotations

import os
from pathlib import Path

from charlie.devbox.policy import Limits
from charlie.sandbox import SandboxPolicy, SandboxUnavailable, check_mode


def workspace_policy(
    root: Path,
    limits: Limits,
    workspace: Path,
    *,
    network: bool = False,
    frozen: tuple[Path, ...] = (),
) -> SandboxPolicy:
    """The sandbox of a program running on ``workspace`` of the devbox at ``root``."""
    return SandboxPolicy(
        workspace=Path(os.path.realpath(workspace)),
        hidden=(root, *limits.hidden),
        readable=limits.readable,
        network=network,
        network_stack=limits.network_stack,
        unreachable=limits.unreachable,
        frozen=frozen,
    )


def git_policy(root: Path, limits: Limits, workspace: Path) -> SandboxPolicy | None:
    """The confinement of the devbox's git on ``workspace``: its commands' own, without network.

    None where commands themselves run unconfined (the operator's ``--no-sandbox``: a command
    has the devbox's rights, so a git it steers gains none), or where no sandbox can run and
    commands are therefore refused (no command exists to steer git).
    """
    if limits.sandbox == "off":
        return None
    try:
        check_mode(limits.sandbox)
    except SandboxUnavailable:
        return None
    return workspace_policy(root, limits, workspace)
