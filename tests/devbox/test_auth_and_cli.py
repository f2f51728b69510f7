"""The token guards every route; the client's errors never leak it; the CLI insists on one, of
at least 32 characters, and so do the devbox and the workers."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from charlie.config import load_settings
from charlie.devbox import DevboxClient, DevboxError, DevboxServer, DevboxUnavailable
from charlie.devbox.cli import devbox
from charlie.devbox.credentials import MIN_TOKEN_LENGTH
from charlie.tools import devbox_tools
from charlie.tools.context import ToolError

from .conftest import TOKEN


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
    ],
)
def test_requests_without_the_token_get_401(server: DevboxServer, headers: dict[str, str]) -> None:
    for method, path in (("GET", "/health"), ("PUT", "/workspaces/x"), ("GET", "/nope")):
        response = httpx.request(method, server.url + path, headers=headers, json={"repo": None})
        assert response.status_code == 401
        assert "token" in response.json()["error"]
    assert not (server.root / "workspaces" / "x").exists()


def test_client_error_does_not_carry_the_token(server: DevboxServer) -> None:
    with DevboxClient(server.url, "not-the-token") as bad, pytest.raises(DevboxError) as info:
        bad.health()
    assert info.value.status == 401
    assert "not-the-token" not in str(info.value)
    assert "not-the-token" not in repr(bad)


def test_client_rejects_unsendable_token_without_echoing_it() -> None:
    with pytest.raises(ValueError) as info:
        DevboxClient("http://127.0.0.1:1", "secret with\nnewline")
    assert "secret" not in str(info.value)


def test_unreachable_devbox() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with DevboxClient(f"http://127.0.0.1:{port}", TOKEN) as c, pytest.raises(DevboxUnavailable):
        c.health()


def test_unknown_route_and_method(client: DevboxClient, server: DevboxServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(server.url + "/nope", headers=auth).status_code == 404
    assert httpx.post(server.url + "/health", headers=auth).status_code == 405
    response = httpx.put(server.url + "/workspaces/x", headers=auth, content=b"not json")
    assert response.status_code == 400


def test_second_server_on_same_root_refused(server: DevboxServer) -> None:
    with pytest.raises(RuntimeError, match="already serving"):
        DevboxServer(server.root, TOKEN)


def test_cli_refuses_without_token(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        devbox, ["serve", "--root", str(tmp_path)], env={"CHARLIE_DEVBOX_TOKEN": ""}
    )
    assert result.exit_code != 0
    assert "token" in result.output


_SHORT = "s3cret-but-short-0123456789abcd"  # 31 characters


def test_devbox_refuses_a_token_under_32_characters(tmp_path: Path) -> None:
    assert MIN_TOKEN_LENGTH == 32 and len(_SHORT) == 31 and len(TOKEN) >= 32
    with pytest.raises(ValueError, match="at least 32") as info:
        DevboxServer(tmp_path / "short", _SHORT)
    assert _SHORT not in str(info.value)
    DevboxServer(tmp_path / "long", "x" * 32).stop()  # 32 is enough


def test_cli_refuses_a_token_under_32_characters(tmp_path: Path) -> None:
    for env, args in (
        ({"CHARLIE_DEVBOX_TOKEN": _SHORT}, []),
        ({"CHARLIE_DEVBOX_TOKEN": ""}, ["--token", _SHORT]),
    ):
        result = CliRunner().invoke(devbox, ["serve", "--root", str(tmp_path), *args], env=env)
        assert result.exit_code == 2, result.output
        assert "refusing to start" in result.output and "at least 32" in result.output
        assert "31 characters" in result.output and _SHORT not in result.output


def test_a_worker_refuses_a_token_under_32_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHARLIE_DEVBOX_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("CHARLIE_DEVBOX_TOKEN", _SHORT)
    monkeypatch.setattr(devbox_tools, "settings", load_settings)
    with pytest.raises(ToolError, match="at least 32") as info:
        devbox_tools.current_config()
    assert _SHORT not in str(info.value.as_result())
    monkeypatch.setenv("CHARLIE_DEVBOX_TOKEN", TOKEN)
    assert devbox_tools.current_config().token == TOKEN
