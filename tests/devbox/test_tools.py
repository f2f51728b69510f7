"""The devbox tools at the handler level: a real devbox over HTTP, a ToolContext made by hand.

These check what a tool call turns the devbox's answers into (results, errors the model sees,
pending waits, read-backs); the cluster tests (tests/integration/test_devbox_tools.py,
tests/recovery/test_devbox_recovery.py) check the same tools through real workers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from charlie.devbox import DevboxServer, Limits
from charlie.domain import Effect, Outcome
from charlie.testing import FakeChildren, ToolEnvironment
from charlie.tools import builtins, devbox_tools
from charlie.tools.context import Pending, Reconciled, ToolContext, ToolError
from charlie.tools.devbox_tools import DevboxConfig
from charlie.tools.registry import ToolRegistry, build_tool

from .conftest import TOKEN, ServerFactory

pytestmark = pytest.mark.timeout(60)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=T", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@dataclass
class Calls:
    """Makes ToolContexts for one task and keeps what they recorded."""

    workspace: Path
    metadata: dict[str, Any] = field(default_factory=dict)
    task_id: str = "task-1"
    handles: list[str] = field(default_factory=list)

    def ctx(
        self, call_id: str = "c1", turn: int = 0, handle: str | None = None, resumed: bool = False
    ) -> ToolContext:
        return ToolContext(
            task_id=self.task_id,
            execution_id=f"x-{self.task_id}",
            call_id=call_id,
            turn=turn,
            workspace=self.workspace,
            metadata=self.metadata,
            resumed=resumed,
            handle=handle,
            _record_handle=self.handles.append,
        )


@pytest.fixture
def use_devbox(monkeypatch: pytest.MonkeyPatch) -> Callable[..., DevboxConfig]:
    """Point the tools at a devbox (as CHARLIE_DEVBOX_URL/TOKEN would in a worker)."""

    def use(server: DevboxServer, token: str = TOKEN, inline_wait: float = 10.0) -> DevboxConfig:
        config = DevboxConfig(server.url, token, 10.0, inline_wait, 0.2)
        monkeypatch.setattr(devbox_tools, "current_config", lambda: config)
        return config

    return use


@pytest.fixture
def box(
    server: DevboxServer, use_devbox: Callable[..., DevboxConfig], tmp_path: Path
) -> Iterator[Calls]:
    use_devbox(server)
    yield Calls(tmp_path / "local")


def ws_path(server: DevboxServer, calls: Calls) -> Path:
    spec = devbox_tools.workspace_spec(calls.task_id, calls.metadata)
    return server.root / "workspaces" / spec.workspace_id


def finish(calls: Calls, result: Any, call_id: str = "c1", timeout: float = 15.0) -> dict[str, Any]:
    """Observe a parked run_command again (as the sweep would) until it has a result."""
    seen: list[Any] = [result]
    while isinstance(seen[-1], Pending):
        handle = seen[-1].handle
        time.sleep(0.05)
        seen.append(devbox_tools.run_command("unused", calls.ctx(call_id, handle=handle)))
        assert len(seen) < 200
    final: dict[str, Any] = seen[-1]
    return final


# -- the tool set --------------------------------------------------------------------------


def test_same_names_and_parameters_as_the_local_tools() -> None:
    registry = ToolRegistry()
    for fn in (builtins.read_file, builtins.write_file, builtins.list_files, builtins.run_command):
        registry.add(build_tool(fn, effect="write"))
    local = {name: registry.get(name) for name in registry.names()}
    devbox_tools.install(registry)
    assert set(registry.names()) == set(local) | {"apply_patch", "git_diff", "git_commit"}
    for name, before in local.items():
        after = registry.get(name)
        assert before is not None and after is not None and after is not before
        assert after.parameters == before.parameters, name
        assert after.description == before.description, name
    run = registry.get("run_command")
    assert run is not None and run.effect is Effect.WAIT and run.resumable
    commit = registry.get("git_commit")
    assert commit is not None and commit.effect is Effect.WRITE and commit.reconcile is not None


def test_workspace_is_built_from_metadata_and_named_by_the_task_id() -> None:
    assert devbox_tools.workspace_spec("t1", {}).workspace_id == "t1"
    odd = devbox_tools.workspace_id_for("demo:a..b")
    assert odd.startswith("demo-a-b-") and odd == devbox_tools.workspace_id_for("demo:a..b")
    assert devbox_tools.workspace_id_for("demo:a..b") != devbox_tools.workspace_id_for("demo-a-b")
    spec = devbox_tools.workspace_spec(
        "t1", {"devbox": {"repo": "/r", "branch": "b", "workspace_id": "t1"}}
    )
    assert (spec.workspace_id, spec.repo, spec.branch, spec.base_commit) == ("t1", "/r", "b", None)
    # the metadata may not name another workspace; a child's is its owner's
    with pytest.raises(ToolError, match="not this task's workspace"):
        devbox_tools.workspace_spec("t1", {"devbox": {"workspace_id": "shared"}})
    child = devbox_tools.workspace_spec("t1.0.d1", {"devbox": {"workspace_id": "t1"}}, owner="t1")
    assert child.workspace_id == "t1"
    with pytest.raises(ToolError, match="unknown key"):
        devbox_tools.workspace_spec("t1", {"devbox": {"repository": "/r"}})
    with pytest.raises(ToolError, match="non-empty string"):
        devbox_tools.workspace_spec("t1", {"devbox": {"branch": 3}})

    # a delegated child records the parent's workspace id explicitly
    def inherit(ctx: ToolContext) -> Any:
        """What a child of this task inherits."""
        return devbox_tools.inherited_devbox(ctx, {"devbox": {"repo": "/r"}})

    children = FakeChildren()
    children.add("root")
    children.add("parent.d1", parent_id="root")
    inherited = ToolEnvironment(task_id="parent.d1", children=children).run(inherit)
    assert inherited.result == {"workspace_id": "root", "repo": "/r"}


def test_devbox_metadata_pins_a_local_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    meta = devbox_tools.devbox_metadata(str(repo), branch="fix/new-branch")
    assert meta == {"repo": str(repo), "branch": "fix/new-branch", "base_commit": head}


# -- files and confinement -----------------------------------------------------------------


def test_files_round_trip_and_listing(box: Calls) -> None:
    assert devbox_tools.write_file("pkg/a.py", "A = 1\n", box.ctx()) == {
        "path": "pkg/a.py",
        "bytes": 6,
    }
    devbox_tools.write_file("b.txt", "b", box.ctx("c2"))
    devbox_tools.write_file(".hidden", "h", box.ctx("c3"))
    assert devbox_tools.read_file("pkg/a.py", box.ctx("c4")) == "A = 1\n"
    assert devbox_tools.list_files(box.ctx("c5")) == ["b.txt", "pkg/a.py"]
    assert devbox_tools.list_files(box.ctx("c6"), "pkg") == ["pkg/a.py"]


def test_path_and_symlink_escapes_are_refused(box: Calls, server: DevboxServer) -> None:
    devbox_tools.write_file("inside.txt", "fine", box.ctx())
    outside = server.root.parent / "secret.txt"
    outside.write_text("do not read")
    (ws_path(server, box) / "leak").symlink_to(outside)
    with pytest.raises(ToolError, match=r"contains '\.\.'"):
        devbox_tools.read_file("../secret.txt", box.ctx("c2"))
    with pytest.raises(ToolError, match="absolute"):
        devbox_tools.write_file("/tmp/x", "no", box.ctx("c3"))
    with pytest.raises(ToolError, match="outside the workspace") as refused:
        devbox_tools.read_file("leak", box.ctx("c4"))
    assert "do not read" not in str(refused.value.as_result())
    with pytest.raises(ToolError, match="outside the workspace"):
        devbox_tools.write_file("leak", "overwrite", box.ctx("c5"))
    assert outside.read_text() == "do not read"


def test_wrong_token_is_refused_and_never_shown(
    server: DevboxServer, use_devbox: Callable[..., DevboxConfig], tmp_path: Path
) -> None:
    use_devbox(server, token="not-the-token-0123456789abcdefghij")
    calls = Calls(tmp_path)
    with pytest.raises(ToolError, match="refused this worker's credentials") as refused:
        devbox_tools.read_file("a.txt", calls.ctx())
    result = refused.value.as_result()
    assert result["devbox_status"] == 401
    assert "not-the-token-0123456789abcdefghij" not in str(result) and TOKEN not in str(result)


def test_unreachable_devbox_is_a_tool_error(
    use_devbox: Callable[..., DevboxConfig], make_server: ServerFactory, tmp_path: Path
) -> None:
    server = make_server()
    use_devbox(server)
    server.stop()
    with pytest.raises(ToolError, match="unreachable"):
        devbox_tools.write_file("a.txt", "x", Calls(tmp_path).ctx())


# -- commands --------------------------------------------------------------------------------


def test_command_runs_once_and_is_observed_by_its_execution_id(
    server: DevboxServer, use_devbox: Callable[..., DevboxConfig], tmp_path: Path
) -> None:
    use_devbox(server, inline_wait=0.0)  # park at once, as a long command would
    calls = Calls(tmp_path)
    marker = "echo ran >> marker.txt; sleep 0.5; echo out; echo err >&2"
    first = devbox_tools.run_command(marker, calls.ctx())
    assert isinstance(first, Pending)
    assert calls.handles == [first.handle]  # recorded before returning
    result = finish(calls, first)
    assert result["exit_code"] == 0 and result["stdout"] == "out\n" and result["stderr"] == "err\n"
    assert result["execution_id"] == first.handle and result["status"] == "exited"
    assert (ws_path(server, calls) / "marker.txt").read_text() == "ran\n"
    # a call that lost its answer before recording the id starts again with the same key:
    # the devbox returns the same command instead of running it twice
    again = devbox_tools.run_command(marker, calls.ctx(resumed=True))
    assert isinstance(again, dict) and again["execution_id"] == first.handle
    assert again["resumed"] is True
    assert calls.handles == [first.handle, first.handle]
    assert (ws_path(server, calls) / "marker.txt").read_text() == "ran\n"
    assert len(list((server.root / "commands").glob("*/meta.json"))) == 1


def test_failed_command_is_an_error_with_its_output(box: Calls) -> None:
    with pytest.raises(ToolError, match="exited with code 3") as failed:
        devbox_tools.run_command("echo before; echo why >&2; exit 3", box.ctx())
    result = failed.value.as_result()
    assert result["exit_code"] == 3
    assert result["stdout"] == "before\n" and result["stderr"] == "why\n"


def test_output_beyond_the_cap_is_truncated_and_says_so(
    make_server: ServerFactory, use_devbox: Callable[..., DevboxConfig], tmp_path: Path
) -> None:
    use_devbox(make_server(limits=Limits(output_bytes=1000)))
    result = devbox_tools.run_command("python3 -c \"print('x' * 5000)\"", Calls(tmp_path).ctx())
    assert isinstance(result, dict)
    assert result["truncated"] is True
    assert "[output truncated at 1000 bytes]" in result["stdout"]
    assert "5001 bytes" in result["note"]
    assert len(result["stdout"]) < 1100


def test_command_lost_in_a_devbox_restart_says_so(
    make_server: ServerFactory, use_devbox: Callable[..., DevboxConfig], tmp_path: Path
) -> None:
    first = make_server()
    use_devbox(first, inline_wait=0.0)
    calls = Calls(tmp_path)
    pending = devbox_tools.run_command("sleep 30", calls.ctx())
    assert isinstance(pending, Pending)
    first.stop()
    # while the devbox is down the wait goes on (its deadline bounds it)...
    assert isinstance(
        devbox_tools.run_command("sleep 30", calls.ctx(handle=pending.handle)), Pending
    )
    use_devbox(make_server(), inline_wait=0.0)
    # ...and once it is back it reports the command lost: never run again, never "succeeded"
    with pytest.raises(ToolError, match="restarted while the command was running") as lost:
        devbox_tools.run_command("sleep 30", calls.ctx(handle=pending.handle, resumed=True))
    assert lost.value.as_result()["status"] == "lost"
    assert calls.handles == [pending.handle]


def test_unknown_execution_id_is_an_error_not_a_new_command(box: Calls) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    with pytest.raises(ToolError, match="no record of command"):
        devbox_tools.run_command("echo never", box.ctx(handle=missing, resumed=True))
    assert box.handles == []


# -- git -------------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "settings.py").write_text("PREFIXES = (';',)\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "2.4")
    return repo, _git(repo, "rev-parse", "HEAD")


def test_patch_diff_commit_and_read_back(box: Calls, repo: tuple[Path, str]) -> None:
    upstream, base = repo
    box.metadata = {"devbox": {"repo": str(upstream), "branch": "fix", "base_commit": base}}
    diff = (
        "--- a/settings.py\n+++ b/settings.py\n@@ -1 +1 @@\n"
        "-PREFIXES = (';',)\n+PREFIXES = ('#', ';')\n"
    )
    assert devbox_tools.apply_patch(diff, box.ctx()) == {"applied": True, "files": ["settings.py"]}
    shown = devbox_tools.git_diff(box.ctx("c2"))
    assert "+PREFIXES = ('#', ';')" in shown["diff"]
    with pytest.raises(ToolError, match="patch does not apply"):
        devbox_tools.apply_patch(diff, box.ctx("c3"))
    ctx = box.ctx("commit", turn=3)
    done = devbox_tools.git_commit("Restore '#' comments", ctx)
    assert done["created"] is True and done["branch"] == "fix"
    assert done["idempotency_key"] == "charlie:task-1/3/commit"
    # the reconcile hook reads the commit back by this call's key...
    found = devbox_tools._commit_landed("Restore '#' comments", box.ctx("commit", turn=3))
    assert found == Reconciled(
        Outcome.OK,
        {"commit": done["commit"], "created": True, "idempotency_key": done["idempotency_key"]},
    )
    # ...and another call's key finds nothing: that commit did not happen
    missing = devbox_tools._commit_landed("x", box.ctx("other", turn=3))
    assert missing is not None and missing.outcome is Outcome.ERROR
    assert "not committed" in missing.result["error"]
    # committing again under the same call returns the first commit
    assert devbox_tools.git_commit("again", box.ctx("commit", turn=3))["commit"] == done["commit"]


def test_a_lost_workspace_is_rebuilt_from_the_metadata(
    box: Calls, server: DevboxServer, repo: tuple[Path, str]
) -> None:
    upstream, base = repo
    box.metadata = {"devbox": {"repo": str(upstream), "branch": "fix", "base_commit": base}}
    devbox_tools.write_file("settings.py", "changed\n", box.ctx())
    shutil.rmtree(ws_path(server, box))  # the devbox lost it (disk wiped, new machine)
    again = devbox_tools.read_file("settings.py", box.ctx("c2", turn=2))
    assert isinstance(again, dict)
    assert again["content"] == "PREFIXES = (';',)\n"  # the recorded base, not the lost edit
    assert "rebuilt from" in again["workspace_rebuilt"] and base in again["workspace_rebuilt"]
    assert _git(ws_path(server, box), "rev-parse", "--abbrev-ref", "HEAD") == "fix"
    shutil.rmtree(ws_path(server, box))
    with pytest.raises(ToolError, match="nothing committed"):
        devbox_tools.git_commit("would commit nothing", box.ctx("c3", turn=3))
