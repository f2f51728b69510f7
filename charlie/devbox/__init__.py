"""The devbox: where work runs, not where truth lives (I20).

The devbox is a small HTTP service that owns git workspaces and runs commands in them on behalf
of Charlie's tools (run_command, read_file, write_file, list_files, apply_patch, git_diff,
git_commit). Workers reach it over HTTP with a bearer token, so they may run on other machines.

Design:

* **No run truth.** Which tool call ran, and what the run decided, lives in Charlie's database.
  The devbox only keeps what it needs to answer questions about its own work: workspaces and,
  per command, a small metadata file plus its output.
* **Commands by execution id.** ``start_command`` returns a uuid execution id at once; the
  command runs detached (its own session), not tied to the HTTP request or to the worker that
  asked. The id is recorded on the tool call, and any worker (including one started after the
  first was SIGKILLed) polls ``command_status(id)`` to completion.
* **Restart means lost.** A command that was running when the devbox stopped or died is reported
  ``lost`` (never as succeeded): its output pipes and watcher died with the devbox, so its exit
  is unknowable. On startup the devbox marks every command still ``running`` on disk as lost,
  after SIGKILLing its process group if the pid is provably still that command (same start
  time, session leader) so no orphan keeps changing the workspace.
* **Idempotent commits.** ``commit(message, key)`` writes ``Charlie-Idempotency-Key: <key>`` as a
  trailer and returns the existing commit on a retry; ``find_commit(key)`` is the read-back a
  reconcile hook uses to learn whether a commit happened.
* **Guard rails, not a sandbox.** Paths must stay inside the workspace, programs are checked
  against an allow/deny policy, commands get a minimal environment without the devbox's secrets,
  output and time and workspace size are capped. Isolation from the host is the job of the
  machine or container the devbox runs in.
"""

from charlie.devbox.client import (
    CommandStatus,
    CommitResult,
    DevboxClient,
    DevboxError,
    DevboxUnavailable,
    Diff,
    FileContent,
    FileEntry,
    PatchResult,
    StartedCommand,
    Workspace,
)
from charlie.devbox.credentials import workspace_credential
from charlie.devbox.policy import CommandPolicy, Limits, RepoPolicy
from charlie.devbox.server import DevboxServer

__all__ = [
    "CommandPolicy",
    "CommandStatus",
    "CommitResult",
    "DevboxClient",
    "DevboxError",
    "DevboxServer",
    "DevboxUnavailable",
    "Diff",
    "FileContent",
    "FileEntry",
    "Limits",
    "PatchResult",
    "RepoPolicy",
    "StartedCommand",
    "Workspace",
    "workspace_credential",
]
