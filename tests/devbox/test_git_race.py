"""The devbox's own git runs confined like the commands, so a command racing it gains nothing.

A command runs in the sandbox but writes its workspace, ``.git`` included. The devbox checks
the repository's config before each git operation and a command cannot write ``.git/config``
itself, yet between the check and git's read a command running in the background can point
``.git/commondir`` at a config of its own, rename ``.git`` and put a copy with its own config
in its place, or replace ``.git`` with a gitfile (``gitdir: ...``) naming such a copy. Git then
runs the clean filter that config names. The devbox's git runs in the same bubblewrap
confinement as commands (its root and the token out of sight, no network, its own pid
namespace), so the filter runs with no more than a command's rights: it cannot write outside
the workspace, and it finds no token (docs/security.md, "What an injected model cannot do":
commands cannot reach Charlie's secrets; git in the devbox runs no program the agent configured
outside that confinement).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from charlie.devbox import DevboxClient, DevboxError
from tests.devbox.conftest import TOKEN, ServerProcess
from tests.support.cluster import TEST_SANDBOX

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(TEST_SANDBOX != "bwrap", reason="needs bubblewrap (the race is sandboxed)"),
    pytest.mark.backend_free,
]

#: git's clean filter as the attacker writes it: it records where it ran inside the workspace
#: (what a command could do anyway), then tries what only an unconfined program could: write a
#: file outside the workspace, and find the devbox token in any process's environment.
_FILTER = """\
#!/bin/sh
echo ran >> "{ws}/.filter-ran"
found=$(cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' \\
        | grep -a DEVBOX_TOKEN=)
echo "token: $found" >> "{ws}/.filter-ran"
echo "ran outside the sandbox; token: $found" >> "{marker}"
cat
"""

#: the background command: build the attacker's configs, then keep swapping one in.
_ATTACK = """\
set -u
W=$(pwd)
F="sh $W/.agent/filter.sh"
# a whole copy of .git whose config names the filter: what a rename or a gitfile points at
cp -a .git .alt
git config -f .alt/config filter.x.clean "$F"
# a common dir inside .git: the real objects and refs, and a config that includes the filter's
mkdir -p .git/evil
ln -s ../objects .git/evil/objects
ln -s ../refs .git/evil/refs
printf '[include]\\n\\tpath = %s\\n' "$W/.alt/config" > .git/evil/config
echo ready
while :; do
{swap}
done
"""

#: one way to change what the devbox's git reads, undone right after, over and over
_SWAPS = {
    "commondir": "echo evil > .git/commondir; sleep 0.005; rm -f .git/commondir",
    "rename": "mv .git .orig && mv .alt .git; sleep 0.005; mv .git .alt; mv .orig .git",
    "gitfile": (
        'mv .git .orig && echo "gitdir: $W/.alt" > .git; sleep 0.005; rm -f .git; mv .orig .git'
    ),
}


def _wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("swap", sorted(_SWAPS))
def test_a_command_racing_the_devbox_git_runs_nothing_outside_the_sandbox(
    spawn_server: Callable[..., ServerProcess], tmp_path: Path, swap: str
) -> None:
    # a devbox process with the token in its environment, as `charlie devbox serve` runs
    proc = spawn_server()
    outside = tmp_path / "outside-the-workspace"
    outside.mkdir()
    marker = outside / "marker"
    with DevboxClient(proc.url, TOKEN) as client:
        client.ensure_workspace("ws", None)
        ws = Path(client.get_workspace("ws").path)
        client.write_file("ws", "data.txt", "zero\n")
        client.commit("ws", "data", "k-data")
        client.write_file("ws", ".agent/filter.sh", _FILTER.format(ws=ws, marker=marker))
        client.write_file("ws", ".gitattributes", "* filter=x\n")
        attack = client.start_command("ws", shell=_ATTACK.format(swap=_SWAPS[swap]))
        _wait_for(lambda: "ready" in client.command_status(attack.execution_id).stdout_tail, 60)
        ran = ws / ".filter-ran"
        outcomes: dict[str, int] = {}
        deadline = time.monotonic() + 150
        attempt = 0
        try:
            # until the filter has been seen to run (the race won) a few times, or time is up
            while time.monotonic() < deadline and not marker.exists():
                if attempt >= 20 and ran.exists() and ran.read_text().count("ran") >= 3:
                    break
                attempt += 1
                for name in ("diff", "commit"):
                    try:
                        client.write_file("ws", "data.txt", f"{name} {attempt}\n")
                        if name == "diff":
                            client.diff("ws")
                        else:
                            client.commit("ws", f"change {attempt}", f"k-{attempt}")
                        outcomes[name] = outcomes.get(name, 0) + 1
                    except DevboxError as exc:  # the attack leaves .git broken at times
                        outcomes[str(exc.status)] = outcomes.get(str(exc.status), 0) + 1
            status = client.command_status(attack.execution_id)
            assert status.status == "running", status  # the attack ran throughout
        finally:
            client.cancel_command(attack.execution_id)
    assert not marker.exists(), f"{marker.read_text()} after {attempt} rounds: {outcomes}"
    # the filter did run (the race was won), confined: it found no token
    seen = ran.read_text() if ran.exists() else ""
    assert seen.count("ran") >= 3, (attempt, outcomes, seen)
    assert TOKEN not in seen


def _processes_with(needle: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_confined_git_past_its_timeout_ends_with_everything_it_started(tmp_path: Path) -> None:
    # a program git runs (a filter the race let through) that hangs and leaves a child behind:
    # the timeout kills git's group, and the pid namespace takes the rest
    from charlie.devbox import git
    from charlie.devbox.confinement import git_policy
    from charlie.devbox.errors import ApiError
    from charlie.devbox.policy import Limits

    ws = tmp_path / "root" / "workspaces" / "ws"
    ws.mkdir(parents=True)
    git.run_git(["init", "-q"], ws, timeout=30, confine=None)
    needle = f"{time.monotonic_ns() % 10**6}.5"  # sleep takes a fraction; this names it
    (ws / ".gitattributes").write_text("* filter=x\n")
    (ws / "a.txt").write_text("a\n")
    with open(ws / ".git" / "config", "a") as config:
        config.write(
            f'[filter "x"]\n\tclean = "sh -c \'setsid sleep {needle} & sleep {needle}\'"\n'
        )
    policy = git_policy(tmp_path / "root", Limits(), ws)
    assert policy is not None
    with pytest.raises(ApiError) as info:
        # the private runner: the public one would refuse this config before running git
        git._run(["add", "-A"], ws, ws, timeout=2, confine=policy)
    assert info.value.status == 504
    _wait_for(lambda: not _processes_with(f"sleep {needle}"), 10)
