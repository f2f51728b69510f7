"""The command policy's reading of argv and shell strings."""

from __future__ import annotations

import pytest

from charlie.devbox.errors import ApiError
from charlie.devbox.policy import (
    CommandPolicy,
    argv_command_names,
    command_env,
    is_secret_name,
    shell_command_names,
)


@pytest.mark.parametrize(
    ("shell", "names"),
    [
        ("echo hi", ["echo"]),
        ("FOO=1 make test", ["make"]),
        ("make && sudo rm -rf /", ["make", "sudo", "rm"]),
        ("ls | grep x; cat y", ["ls", "grep", "cat"]),
        ("if true; then reboot; fi", ["true", "reboot"]),
        ("echo a > sudo", ["echo"]),
        ("echo 'a; sudo b'", ["echo"]),
        ("env -i X=1 timeout 5 halt", ["env", "timeout", "halt"]),
        ("echo a\nshutdown now", ["echo", "shutdown"]),
    ],
)
def test_shell_command_names(shell: str, names: list[str]) -> None:
    assert shell_command_names(shell) == names


def test_argv_names_and_policy() -> None:
    assert argv_command_names(["/usr/bin/nohup", "sudo", "x"]) == ["/usr/bin/nohup", "sudo", "x"]
    policy = CommandPolicy()
    policy.check(["ls", "/usr/bin/python3"])
    with pytest.raises(ApiError) as info:
        policy.check(["/usr/bin/sudo"])
    assert info.value.status == 403 and "'sudo'" in info.value.message
    with pytest.raises(ApiError):
        shell_command_names("echo 'unterminated")


def test_secret_names_and_env() -> None:
    for name in ("CHARLIE_DEVBOX_TOKEN", "FOO_API_KEY", "db_password", "GH_TOKEN", "AWS_SECRET"):
        assert is_secret_name(name)
    assert not is_secret_name("PATH")
    env = command_env("/ws", {"X": "1"})
    assert env["HOME"] == "/ws" and env["X"] == "1"
    assert set(env) == {"PATH", "HOME", "LANG", "GIT_TERMINAL_PROMPT", "X"}
