"""The token guards every route; the client's errors never leak it; the CLI insists on one."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from charlie.devbox import DevboxClient, DevboxError, DevboxServer, DevboxUnavailable
from charlie.devbox.cli import devbox

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
